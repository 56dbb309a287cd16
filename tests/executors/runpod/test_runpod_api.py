"""The SDK wrapper against the loopback fake: calls, retries, errors, and what reaches GraphQL."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executors.runpod.api import (
    AuthError,
    NoCapacity,
    RunpodApiError,
    TransientError,
    check_plain,
    escape_env,
    gql_escape,
    rate_from_gpu,
    resolve_api_key,
)
from tests.executors.runpod.conftest import fast_api
from tests.fakes.runpod_api import FakeRunpod, GraphQLSyntaxError, Parser, tokenize

GPU = "NVIDIA GeForce RTX 4090"


async def create(api, fake: FakeRunpod, **kwargs) -> dict:
    args = {"name": "obd-r1", "image_name": "img:1", "gpu_type_id": GPU, "cloud_type": "SECURE", "env": {"A": "1"}}
    args.update(kwargs)
    return await api.create_pod(**args)


async def test_the_sdk_creates_gets_lists_and_terminates_a_pod_on_the_fake(fake: FakeRunpod) -> None:
    api = fast_api()
    raw = await create(api, fake, env={"OBD_RUN_ID": "r1", "OBD_OWNER": "me"})
    pod = await api.get_pod(raw["id"])
    assert pod is not None and pod.name == "obd-r1" and pod.env == {"OBD_RUN_ID": "r1", "OBD_OWNER": "me"}
    assert pod.cost_per_hr == pytest.approx(0.69)
    assert [p.id for p in await api.list_pods()] == [raw["id"]]
    await api.terminate(raw["id"])
    assert await api.get_pod(raw["id"]) is None
    assert await api.list_pods() == []
    await api.terminate(raw["id"])  # a pod already gone counts as terminated


async def test_the_public_ssh_port_is_read_from_the_runtime_ports(fake: FakeRunpod) -> None:
    fake.ssh_endpoint = ("127.0.0.1", 40022)
    api = fast_api()
    raw = await create(api, fake)
    pod = await api.get_pod(raw["id"])
    assert pod is not None and (pod.ssh_host, pod.ssh_port) == ("127.0.0.1", 40022)


@pytest.mark.parametrize("kind", ["429", "500", "502", "503", "nodata", "drop_before"])
async def test_reads_are_retried_with_backoff_on_429_and_5xx(fake: FakeRunpod, kind: str) -> None:
    fake.inject(kind, op="myself", times=2)
    assert await fast_api().list_pods() == []
    assert [s for op, s in fake.calls if op == "myself"][-1] == 200
    assert len([1 for op, _ in fake.calls if op == "myself"]) == 3


async def test_reads_give_up_after_the_retries_with_a_message_saying_what_to_do(fake: FakeRunpod) -> None:
    fake.inject("503", op="myself", times=10)
    with pytest.raises(TransientError, match="gave up after 3 tries"):
        await fast_api(retries=2).list_pods()


async def test_a_call_that_hangs_is_abandoned_at_the_deadline(fake: FakeRunpod) -> None:
    fake.inject("timeout", op="myself", delay=3)
    with pytest.raises(TransientError, match="did not answer"):
        await fast_api(call_timeout=0.3, retries=0).list_pods()


async def test_a_create_is_never_retried_by_the_wrapper(fake: FakeRunpod) -> None:
    fake.inject("502", op="podFindAndDeployOnDemand")
    with pytest.raises(TransientError):
        await create(fast_api(), fake)
    assert fake.ops().count("podFindAndDeployOnDemand") == 1


async def test_a_bad_api_key_is_a_clear_error_naming_where_the_key_comes_from(fake: FakeRunpod) -> None:
    with pytest.raises(AuthError, match="RUNPOD_API_KEY") as info:
        await fast_api(api_key="wrong-key").list_pods()
    assert "wrong-key" not in str(info.value)


async def test_no_api_key_anywhere_is_a_clear_error(
    fake: FakeRunpod, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.delenv("RUNPOD_API_KEY")
    import runpod.cli.groups.config.functions as creds

    monkeypatch.setattr(creds, "CREDENTIAL_FILE", str(tmp_path / "none.toml"))
    with pytest.raises(AuthError, match="runpod config"):
        await fast_api().list_pods()
    assert fake.calls == []


def test_the_key_is_read_from_the_sdk_config_file_when_the_variable_is_unset(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    import runpod.cli.groups.config.functions as creds

    path = tmp_path / "config.toml"
    path.write_text('[default]\napi_key = "from-file"\n')
    monkeypatch.setattr(creds, "CREDENTIAL_FILE", str(path))
    assert resolve_api_key({}) == "from-file"
    assert resolve_api_key({"RUNPOD_API_KEY": "from-env"}) == "from-env"


async def test_no_capacity_is_told_apart_from_other_refusals(fake: FakeRunpod) -> None:
    fake.set_capacity(GPU, 0)
    with pytest.raises(NoCapacity):
        await create(fast_api(), fake)
    assert fake.live_pods() == []


async def test_env_values_with_quotes_newlines_and_backslashes_arrive_intact(fake: FakeRunpod) -> None:
    tricky = 'a "quoted" value\nwith a newline, a \\ backslash, a tab\t, \x01 and ünïcode }) { injected: "x"'
    raw = await create(fast_api(), fake, env={"TRICKY": tricky, "PLAIN": "ok"})
    pod = await fast_api().get_pod(raw["id"])
    assert pod is not None and pod.env["TRICKY"] == tricky and pod.env["PLAIN"] == "ok"
    assert fake.creates[-1]["env"] == [{"key": "TRICKY", "value": tricky}, {"key": "PLAIN", "value": "ok"}]


@pytest.mark.parametrize("name", ["BAD-NAME", "a b", 'X"', "1ABC", ""])
def test_env_names_that_are_not_identifiers_are_refused(name: str) -> None:
    with pytest.raises(RunpodApiError, match="refusing pod env name"):
        escape_env({name: "v"})


def test_env_values_with_nul_bytes_or_too_long_are_refused() -> None:
    with pytest.raises(RunpodApiError):
        escape_env({"A": "x\x00y"})
    with pytest.raises(RunpodApiError):
        escape_env({"A": "x" * 40000})


@pytest.mark.parametrize("value", ['img"}) {', "a\\b", "line\nbreak", ""])
async def test_ids_names_and_images_that_would_change_the_query_are_refused(fake: FakeRunpod, value: str) -> None:
    with pytest.raises(RunpodApiError, match="refusing"):
        await create(fast_api(), fake, image_name=value)
    with pytest.raises(RunpodApiError, match="refusing"):
        check_plain("pod id", value)
    assert fake.creates == []


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_escaped_string_is_read_back_by_a_graphql_parser_as_itself(value: str) -> None:
    surrogate_free = value.encode("utf-16", "surrogatepass").decode("utf-16")
    tokens = tokenize(f'"{gql_escape(surrogate_free)}"')
    assert tokens[0] == ("string", surrogate_free)


@pytest.mark.parametrize("text", ['{ a(x: "bro"ken") { b } }', '{ a(x: "line\nbreak") { b } }'])
def test_an_unescaped_quote_or_newline_breaks_the_fake_parser_like_the_real_api(text: str) -> None:
    with pytest.raises(GraphQLSyntaxError):
        Parser(text).document()


def test_the_hourly_rate_comes_from_the_cloud_price_times_the_gpu_count() -> None:
    gpu = {"securePrice": 0.69, "communityPrice": 0.44, "lowestPrice": {"uninterruptablePrice": 0.44}}
    assert rate_from_gpu(gpu, 2, "SECURE") == pytest.approx(1.38)
    assert rate_from_gpu(gpu, 1, "COMMUNITY") == pytest.approx(0.44)
    assert rate_from_gpu(gpu, 1, "ALL") == pytest.approx(0.69)
    assert rate_from_gpu({"securePrice": None, "communityPrice": None, "lowestPrice": None}, 1, "SECURE") is None
