"""Issue 15: one validation layer. Sampling parameters and every config are msgspec Structs whose
fields carry their constraints; bad values are refused with the field named, whether they come
from keyword arguments, a wire frame, a JSON worker config or a command-line flag; the CLI flags
are generated from the same Structs; serve hands its workers their config as JSON."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import msgspec
import pytest

from radixserve import SamplingParams
from radixserve import protocol as P
from radixserve.cli import ENGINE_FLAGS, _engine_config, build_parser
from radixserve.config import EngineConfig, ServeConfig, WorkerConfig
from radixserve.errors import BadRequestError
from radixserve.flags import from_args
from radixserve.serve import launch
from radixserve.validation import convert

from serve_cluster import ENV

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "cls, data, field",
    [
        (SamplingParams, {"temperature": -1.0}, "temperature"),
        (SamplingParams, {"top_p": 0.0}, "top_p"),
        (SamplingParams, {"max_tokens": 0}, "max_tokens"),
        (SamplingParams, {"max_tokens": "8"}, "max_tokens"),
        (SamplingParams, {"logprobs": 21}, "logprobs"),
        (SamplingParams, {"stop": [""]}, "stop"),
        (SamplingParams, {"stop": ["x"] * 17}, "stop"),
        (SamplingParams, {"presence_penalty": math.inf}, "presence_penalty"),
        (EngineConfig, {"page_size": 0}, "page_size"),
        (EngineConfig, {"dtype": "float8"}, "dtype"),
        (EngineConfig, {"eviction": "mru"}, "eviction"),
        (EngineConfig, {"kv_memory_gb": 0.0}, "kv_memory_gb"),
        (EngineConfig, {"cascade_min_shared_tokens": 0}, "cascade_min_shared_tokens"),
        (ServeConfig, {"port": 70000}, "port"),
        (ServeConfig, {"workers": -1}, "workers"),
        (ServeConfig, {"policy": "random"}, "policy"),
        (ServeConfig, {"heartbeat_timeout": 0.0}, "heartbeat_timeout"),
        (P.Limits, {"max_frame_bytes": 0}, "max_frame_bytes"),
        (WorkerConfig, {}, "router"),
        (WorkerConfig, {"router": "tcp://127.0.0.1:1", "heartbeat": -1.0}, "heartbeat"),
        (WorkerConfig, {"router": "tcp://127.0.0.1:1", "engine": {"max_running": 0}}, "engine.max_running"),
    ],
)
def test_convert_names_the_field(cls, data, field):
    with pytest.raises(BadRequestError) as e:
        convert(data, cls)
    assert e.value.field == field, e.value
    assert str(e.value).startswith((f"{field}: must be ", f"{field}: is required")), e.value


def test_keyword_constructors_still_work_and_validate_checks_them():
    assert SamplingParams(max_tokens=3, temperature=0.0).greedy
    with pytest.raises(BadRequestError) as e:
        SamplingParams(temperature=101.0).validate(vocab_size=10)
    assert e.value.field == "temperature" and "100" in str(e.value) and "101" in str(e.value)
    with pytest.raises(BadRequestError) as e:
        EngineConfig(attention="magic").validate()
    assert e.value.field == "attention" and "flashinfer" in str(e.value)  # the choices are listed
    EngineConfig(cascade_min_shared_tokens=None).validate()
    EngineConfig(cascade_min_shared_tokens=64, kv_memory_gb=2).validate()


def test_a_frame_breaking_a_sampling_range_names_the_parameter():
    frame = msgspec.msgpack.encode({"type": "generate", "id": "r1", "token_ids": [1, 2], "params": {"repetition_penalty": 1e-300}})
    with pytest.raises(P.DecodeError) as e:
        P.decode(frame)
    assert e.value.field == "repetition_penalty" and e.value.request_id == "r1"
    assert str(e.value).startswith("repetition_penalty: must be a number >= 0.01")
    # a shape error stays a frame error
    with pytest.raises(P.DecodeError) as e:
        P.decode(msgspec.msgpack.encode({"type": "generate", "id": "r2", "token_ids": "no"}))
    assert e.value.field == "frame" and e.value.request_id == "r2"


def test_generated_flags_keep_names_defaults_and_help():
    parser = build_parser()
    serve = parser.parse_args(["serve"])
    assert (serve.port, serve.workers, serve.max_inflight, serve.policy, serve.heartbeat_timeout) == (7700, 1, 64, "cache_aware", 3.0)
    assert serve.enable_prefix_cache is True and serve.api_key is None and serve.no_restart is False
    args = parser.parse_args(
        ["serve", "--no-prefix-cache", "--api-key", "a", "--api-key", "b", "--kv-dtype", "int8", "--max-frame-bytes", "1024", "--worker-threads", "2"]
    )
    cfg = from_args(ServeConfig, args, engine=_engine_config(args))
    assert cfg.engine.enable_prefix_cache is False and cfg.api_key == ["a", "b"] and cfg.engine.kv_dtype == "int8"
    assert cfg.max_frame_bytes == 1024 and cfg.worker_threads == 2
    gen = parser.parse_args(["generate", "hi"])
    assert (gen.max_tokens, gen.temperature, gen.top_k, gen.stop) == (32, 0.0, -1, None)
    sub = next(a for a in parser._actions if isinstance(a, type(parser._subparsers._group_actions[0]))).choices
    helps = {a.dest: a.help for a in sub["serve"]._actions}
    assert helps["max_queue"].startswith("requests the router may queue") and helps["page_size"] == "tokens per KV page (default: 1)"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--dtype", "float8"])  # a Literal gives argparse choices
    with pytest.raises(SystemExit):
        parser.parse_args(["worker"])  # --router is required (the field has no default)


def test_bad_flag_value_is_one_line_naming_the_flag_field():
    out = subprocess.run([sys.executable, "-P", "-m", "radixserve.cli", "serve", "--port", "70000"], capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("radixserve: error: port: must be an integer <= 65535")


def test_worker_config_json_round_trip():
    args = build_parser().parse_args(["serve", "--device", "cpu,cpu", "--workers", "3", "--page-size", "4", "--tensor-parallel", "1", "--worker-threads", "2"])
    cfg = from_args(ServeConfig, args, engine=from_args(EngineConfig, args, ENGINE_FLAGS))
    configs = launch.local_worker_configs(cfg, "tcp://127.0.0.1:7701", log_level="WARNING")
    assert [w.worker_id for w in configs] == ["w0", "w1", "w2"]
    for w in configs:
        cmd = launch.worker_command(w)
        assert cmd[:4] == ["-m", "radixserve.serve.launch", "--config-json", cmd[3]]
        back = convert(json.loads(cmd[3]), WorkerConfig)  # what the worker process decodes
        assert back == w
        assert (
            back.engine.page_size == 4 and back.threads == 2 and back.exit_with_parent and back.log_level == "WARNING" and back.router == "tcp://127.0.0.1:7701"
        )
        assert "secret" not in json.loads(cmd[3])  # the worker secret travels in the environment only


def test_serve_hands_its_grammar_timeout_to_its_local_workers():
    """Issue 49: `worker` had --grammar-timeout and `serve` had not, so local workers always
    allowed 10 s per grammar compile."""
    args = build_parser().parse_args(["serve", "--workers", "2", "--grammar-timeout", "2.5"])
    cfg = from_args(ServeConfig, args, engine=from_args(EngineConfig, args, ENGINE_FLAGS))
    assert [w.grammar_timeout for w in launch.local_worker_configs(cfg, "tcp://127.0.0.1:7701")] == [2.5, 2.5]
    default = from_args(ServeConfig, build_parser().parse_args(["serve"]), engine=EngineConfig())
    assert launch.local_worker_configs(default, "tcp://127.0.0.1:7701")[0].grammar_timeout == WorkerConfig(router="x").grammar_timeout == 10.0
    with pytest.raises(BadRequestError, match="grammar_timeout"):  # 0 s would refuse every grammar
        from_args(ServeConfig, build_parser().parse_args(["serve", "--grammar-timeout", "0"]), engine=EngineConfig())


def test_worker_process_refuses_a_bad_json_config_naming_the_field(capsys):
    bad = msgspec.json.encode(WorkerConfig(router="tcp://127.0.0.1:1", engine=EngineConfig(page_size=0))).decode()
    assert launch.main(["--config-json", bad]) == 2
    assert capsys.readouterr().err.strip() == ("radixserve: error: engine.page_size: must be an integer >= 1, got 0; tokens per KV page (default: 1)")
    assert launch.main(["--config-json", "{not json"]) == 2
    assert "--config-json: not JSON" in capsys.readouterr().err


def test_threads_per_worker_in_one_place():
    from radixserve.serve.supervisor import default_threads

    cfg = ServeConfig(workers=2)
    assert {w.threads for w in launch.local_worker_configs(cfg, "tcp://127.0.0.1:1")} == {default_threads(2)}
    assert launch.local_worker_configs(convert({"workers": 0}, ServeConfig), "tcp://127.0.0.1:1") == []  # remote only


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_inflight_per_worker": 0}, "max_inflight_per_worker"),
        ({"heartbeat_timeout_s": 0.0}, "heartbeat_timeout_s"),
        ({"port": 70000}, "port"),
        ({"max_queue": -1}, "max_queue"),
    ],
)
def test_router_refuses_a_config_out_of_range_naming_the_field(kwargs, field):
    from radixserve.serve.router import Router, RouterConfig

    with pytest.raises(BadRequestError, match=field):
        Router(RouterConfig(**kwargs))


def test_router_config_from_serve_flags_passes_its_checks():
    cfg = launch.router_config(convert({"port": 0, "max_inflight": 1, "drain_timeout": 0.0}, ServeConfig))
    cfg.check()
    assert (cfg.port, cfg.max_inflight_per_worker, cfg.drain_s) == (0, 1, 0.0)


def test_structured_output_without_xgrammar_is_a_bad_request_naming_the_extra(monkeypatch):
    """A fresh install without the structured extra answered a tool call (or any grammar) with
    HTTP 500 "ModuleNotFoundError: No module named 'xgrammar'"; it is a 400 saying what to install."""
    import sys

    from radixserve.engine.structured import GrammarCache
    from radixserve.errors import BadRequestError
    from radixserve.sampling_params import StructuredOutput

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    cache = GrammarCache(tokenizer=None, vocab_size=16, stop_token_ids=[1])
    with pytest.raises(BadRequestError, match=r"radixserve\[structured\]"):
        cache.compile(StructuredOutput(choice=["yes", "no"]))
