"""An engine's own KV-event publisher, for `tests/tests/kv_events.rs`: the `ZmqEventPublisher`,
`EventBatch` and event classes of SGLang 0.5.23 (`srt/disaggregation/kv_events.py`) or vLLM
0.33.0 (`vllm/distributed/kv_events.py`), loaded from the released wheels' files
(`scripts/fetch-engine-sources.py`) and run over libzmq (pyzmq) and msgspec, as the engines run
them. Only their imports of the rest of each engine are stood in for (a logger, a config class,
helpers the publisher does not call here).

    python3 engine_kv_publisher.py ENGINE SRC ENDPOINT REPLAY RANK

binds the publisher of data-parallel rank RANK given the engine's base ENDPOINT and REPLAY
(`tcp://127.0.0.1:PORT`; the engine's own `offset_endpoint_port` moves them by the rank), prints
`ready PUB REPLAY`, then reads one JSON batch per line from stdin, `{"events": [{"type":
"BlockStored", ...fields}, ...]}`, publishes it with the engine's `publish` and prints
`published SEQ` once it is sent. Ends at end of input.
"""

import enum
import importlib.util
import json
import logging
import sys
import time
import types


def stub(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__path__ = []  # a package, so submodules resolve
    for k, v in attrs.items():
        setattr(m, k, v)
    sys.modules[name] = m
    return m


class _Config:
    """`KVEventsConfig` stand-in: the publisher only records its settings in one."""

    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


def load(engine: str, src: str):
    if engine == "vllm":
        stub("vllm")
        stub("vllm.config")
        stub("vllm.config.kv_events", KVEventsConfig=_Config)
        stub("vllm.logger", init_logger=logging.getLogger)
        stub("vllm.utils")

        def unused(*_a, **_k):
            raise AssertionError("not called for an explicit loopback endpoint")

        stub(
            "vllm.utils.network_utils",
            get_ip=unused,
            get_tcp_uri=unused,
            is_valid_ipv6_address=unused,
            split_zmq_path=unused,
        )
        stub("vllm.v1")
        stub("vllm.v1.core")
        stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
        stub("vllm.distributed")
        name, path = "vllm.distributed.kv_events", f"{src}/vllm-0.33.0/vllm/distributed/kv_events.py"
    else:
        stub("sglang")
        stub("sglang.srt")
        stub("sglang.srt.runtime_context", get_parallel=lambda: None)
        stub("sglang.srt.utils")
        stub("sglang.srt.utils.network", NetworkAddress=object)
        stub("sglang.srt.disaggregation")
        name = "sglang.srt.disaggregation.kv_events"
        path = f"{src}/sglang-0.5.23/sglang/srt/disaggregation/kv_events.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def publisher(engine: str, mod, endpoint: str, replay: str, rank: int):
    if engine == "vllm":
        # vLLM binds only wildcard endpoints (`_is_bind_endpoint`) and connects to the rest;
        # the test binds on loopback alone, so nothing listens beyond it.
        class Loopback(mod.ZmqEventPublisher):
            _is_bind_endpoint = staticmethod(lambda _endpoint: True)

        return Loopback(data_parallel_rank=rank, endpoint=endpoint, replay_endpoint=replay)
    # SGLang takes `bind` for a concrete address.
    return mod.ZmqEventPublisher(
        attn_dp_rank=rank, endpoint=endpoint, replay_endpoint=replay, bind=True
    )


def event(mod, engine: str, e: dict):
    kind = e.pop("type")
    if engine == "sglang" and "medium" in e:
        # `record_store` passes the enum (`StorageMedium.GPU`), which msgspec writes by value.
        e["medium"] = mod.StorageMedium(e["medium"])
    if "extra_keys" in e and e["extra_keys"] is not None:
        e["extra_keys"] = [tuple(k) if k is not None else None for k in e["extra_keys"]]
    return getattr(mod, kind)(**e)


def main() -> None:
    engine, src, endpoint, replay, rank = sys.argv[1:6]
    mod = load(engine, src)
    pub = publisher(engine, mod, endpoint, replay, int(rank))
    print("ready", pub._endpoint, pub._replay_endpoint, flush=True)
    seq = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        events = [event(mod, engine, e) for e in json.loads(line)["events"]]
        batch = mod.KVEventBatch(ts=time.time(), events=events)
        pub.publish(batch)
        # The publisher thread marks each batch done once it is on the PUB socket.
        pub._event_queue.join()
        print("published", seq, flush=True)
        seq += 1
    pub.shutdown()


if __name__ == "__main__":
    main()
