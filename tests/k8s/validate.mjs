// Validates custom resources against the schemas that @kubernetes-models generates from the
// operators' own API types: reads a JSON array of resources on stdin, prints a JSON array with one
// entry per resource ({kind, name, error}; error null when valid).
import * as keda from "@kubernetes-models/keda/keda.sh/v1alpha1";
import * as monitoring from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";

const MODELS = {
  "keda.sh/v1alpha1": keda,
  "monitoring.coreos.com/v1": monitoring,
};

function check(resource) {
  const model = MODELS[resource.apiVersion]?.[resource.kind];
  if (!model) return `no schema for ${resource.apiVersion} ${resource.kind}`;
  try {
    new model(resource).validate();
    return null;
  } catch (error) {
    return String(error.message ?? error);
  }
}

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const resources = JSON.parse(Buffer.concat(chunks).toString("utf8"));
const results = resources.map((r) => ({ kind: r.kind, name: r.metadata?.name ?? null, error: check(r) }));
process.stdout.write(JSON.stringify(results));
