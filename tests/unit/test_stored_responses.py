"""`previous_response_id` on /v1/responses against an in-memory stand-in for the Redis Cluster: a stored
answer continues its conversation, for its own tenant only; `store: false` keeps nothing."""

from __future__ import annotations

import json

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from services.edge.openai_schema import ApiError, CompletionHeader
from services.edge.protocol import DoneFrame, UsageBody
from services.edge.response_store import ResponseStore, response_key
from services.edge.stored_responses import StoredResponses
from shared.codes import FinishReason

DONE = DoneFrame("c", FinishReason.STOP, UsageBody(prompt_tokens=5, cached_tokens=0, completion_tokens=2))


class FakeRedis:
    """GET and SET with PX, as the cluster client answers them (text: it decodes responses)."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.ttls_ms: dict[str, int] = {}
        self.down = False

    async def get(self, key: str) -> str | None:
        if self.down:
            raise RedisConnectionError("down")
        return self.values.get(key)

    async def set(self, key: str, value: str, px: int) -> None:
        if self.down:
            raise RedisConnectionError("down")
        self.values[key], self.ttls_ms[key] = value, px


def head(n: int) -> CompletionHeader:
    return CompletionHeader(f"resp_{n:032x}", 1700000000, "echo")


async def answer(stored: StoredResponses, n: int, tenant: str = "a", text: str = "reply", **fields):
    """Parse a request as response number `n`, and finish it with `text`; the parsed request."""
    body = json.dumps({"model": "echo", **fields}).encode()
    parsed = await stored.parse(body, "echo", f"c{n}", head(n), tenant)
    if parsed.finished is not None:
        await parsed.finished(text, DONE)
    return parsed


@pytest.fixture
def redis() -> FakeRedis:
    return FakeRedis()


@pytest.fixture
def stored(redis) -> StoredResponses:
    return StoredResponses(ResponseStore(redis, ttl_s=60))  # type: ignore[arg-type]


def turns(parsed) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in parsed.frame.messages]


async def test_a_second_turn_continues_the_first_without_its_instructions(stored, redis):
    await answer(stored, 1, input="Hi, I am Ada.", instructions="be brief", text="Hello Ada.")
    assert redis.ttls_ms[response_key("a", head(1).id)] == 60_000
    second = await answer(stored, 2, input="Who am I?", previous_response_id=head(1).id, instructions="be kind",
                          text="Ada.")  # fmt: skip
    assert turns(second) == [
        ("system", "be kind"), ("user", "Hi, I am Ada."), ("assistant", "Hello Ada."), ("user", "Who am I?")
    ]  # fmt: skip
    body = second.renderer.body("Ada.", DONE)
    assert body["previous_response_id"] == head(1).id and body["store"] is True
    third = await answer(stored, 3, input="And you?", previous_response_id=head(2).id)  # the chain goes on
    assert [content for _, content in turns(third)] == ["Hi, I am Ada.", "Hello Ada.", "Who am I?", "Ada.", "And you?"]


async def test_another_tenants_id_reads_as_unknown(stored):
    await answer(stored, 1, tenant="a", input="secret")
    for tenant, response_id in (("b", head(1).id), ("a", head(9).id), ("a", "resp_not-ours"), ("a", "x" * 64)):
        with pytest.raises(ApiError) as caught:
            await answer(stored, 2, tenant=tenant, input="more", previous_response_id=response_id)
        error = caught.value
        assert (error.status, error.code, error.param) == (400, "previous_response_not_found", "previous_response_id")
        assert error.message == f"Previous response with id '{response_id}' not found."


async def test_a_record_claiming_another_tenant_is_not_read(stored, redis):
    await answer(stored, 1, tenant="a", input="secret")
    redis.values[response_key("b", head(1).id)] = redis.values[response_key("a", head(1).id)]  # copied across
    with pytest.raises(ApiError):
        await answer(stored, 2, tenant="b", input="more", previous_response_id=head(1).id)
    redis.values[response_key("a", head(1).id)] = "not json"
    with pytest.raises(ApiError):
        await answer(stored, 2, tenant="a", input="more", previous_response_id=head(1).id)


async def test_store_false_keeps_nothing_but_may_continue_a_stored_one(stored, redis):
    unstored = await answer(stored, 1, input="Hi", store=False)
    assert unstored.finished is None and redis.values == {}
    assert unstored.renderer.body("x", DONE)["store"] is False
    await answer(stored, 2, input="Hi")
    branch = await answer(stored, 3, input="Again", previous_response_id=head(2).id, store=False)
    assert turns(branch) == [("user", "Hi"), ("assistant", "reply"), ("user", "Again")]
    assert set(redis.values) == {response_key("a", head(2).id)}


async def test_redis_down_refuses_a_continuation_as_retryable_and_loses_only_the_record(stored, redis):
    redis.down = True
    with pytest.raises(ApiError) as caught:
        await answer(stored, 2, input="more", previous_response_id=head(1).id)
    assert (caught.value.status, caught.value.code, caught.value.retry_after) == (503, "unavailable", 1)
    await answer(stored, 3, input="fresh")  # its answer still goes out: storing it only logs
