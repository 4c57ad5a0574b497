// A stored decode library's step, called with the GIL let go (library_call.py says why).
#include <torch/csrc/inductor/aoti_runner/model_container_runner_cpu.h>
#include <torch/csrc/utils/pybind.h>

namespace {

// The inputs are converted before the GIL goes and the outputs after it is back, by pybind11.
std::vector<at::Tensor> run(torch::inductor::AOTIModelContainerRunnerCpu& runner, const std::vector<at::Tensor>& inputs) {
  pybind11::gil_scoped_release released;
  return runner.run(inputs);
}

// Whether this extension takes the runner as PyTorch's binding made it: pybind11 refuses (TypeError) a
// type registered by a module built with another compiler or pybind11 than this one.
bool takes(torch::inductor::AOTIModelContainerRunnerCpu&) { return true; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run, "runner.run(inputs), the GIL let go meanwhile");
  m.def("takes", &takes, "true, or TypeError where `run` could not take this runner");
}
