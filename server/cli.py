"""`python -m server`: load the model, serve the OpenAI API, drain on SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiohttp import web

from scheduler import POLICIES, SchedulerConfig

log = logging.getLogger("prescient.server")
ABORT_GRACE = 3.0
"""Seconds after the drain timeout for aborted requests' handlers to send their last event."""
SHUTDOWN_GRACE = 3.0
"""Seconds aiohttp waits for connections to close at the very end."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from runtime.quantization import QUANTIZATIONS

    p = argparse.ArgumentParser(prog="python -m server", description="Prescient OpenAI-compatible LLM server")
    p.add_argument("--model", default=None,
                   help="a .gguf file or a Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None, help="model id reported by /v1/models")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                   help="auto: run a GGUF's 4/8-bit blocks packed where that is fast (bfloat16 on CPU); "
                        "int8/int4: quantize float weights on load; none: dequantize")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--kv-cache-bytes", type=_bytes, default=None, help="KV cache size, e.g. 1GiB (default 1 GiB)")
    p.add_argument("--block-size", type=int, default=SchedulerConfig.block_size,
                   help=f"tokens per KV cache block (default {SchedulerConfig.block_size})")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--policy", choices=POLICIES, default="vtc", help="admission policy (default vtc: fair)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--api-keys", default=None, help='JSON file {"KEY": {"tenant": "...", "weight": 1}}')
    p.add_argument("--metrics-auth", action="store_true",
                   help="/metrics asks for one of the --api-keys (Prometheus: authorization.credentials)")
    p.add_argument("--no-tenant-metrics", action="store_true",
                   help="export no per-tenant series (they name tenants and show their load)")
    p.add_argument("--max-waiting", type=int, default=256, help="waiting requests beyond this get 429")
    p.add_argument("--max-body-bytes", type=_bytes, default=4 << 20)
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight work on SIGTERM")
    p.add_argument("--throughput-log-seconds", type=float, default=5.0,
                   help="log a throughput line this often while there is work")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def _bytes(text: str) -> int:
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
             "g": 10**9, "gb": 10**9, "gib": 1 << 30}
    number = text.strip().lower().rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text.strip().lower()[len(number):]
    try:
        return int(float(number) * units[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1073741824, 512MiB, 1GiB)") from None


async def serve(args: argparse.Namespace) -> int:
    from runtime import Engine
    from server.app import build_app
    from server.auth import load_api_keys

    keys = load_api_keys(args.api_keys) if args.api_keys else None
    if args.metrics_auth and not keys:   # say so before minutes of model loading
        raise ValueError("--metrics-auth needs --api-keys: /metrics then asks for one of those keys")
    engine = Engine.from_pretrained(
        args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        policy=args.policy, max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching)
    log.info("model %s (%s, %s): %d KV blocks of %d tokens, context %d, policy %s", engine.model_name,
             engine.model.dtype, engine.model.device, engine.kv.num_blocks, engine.kv.block_size,
             engine.max_model_len, args.policy)
    app = build_app(engine, api_keys=keys, max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
                    served_model_name=args.served_model_name, throughput_log_seconds=args.throughput_log_seconds,
                    metrics_auth=args.metrics_auth, tenant_metrics=not args.no_tenant_metrics)
    # Shutdown = drain (--drain-timeout) + ABORT_GRACE for aborted streams to end + SHUTDOWN_GRACE for
    # aiohttp to close connections: keep it inside the deployment's terminationGracePeriodSeconds.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    log.info("serving on http://%s:%d (OpenAI API under /v1)", args.host, args.port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    state = app["state"]
    state.draining = True
    log.info("draining: %d requests in flight, waiting up to %.0fs", state.in_flight, args.drain_timeout)
    deadline = loop.time() + args.drain_timeout
    while state.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if state.in_flight:
        aborted = state.async_engine.abort_all("the server is shutting down and the drain timeout passed")
        log.warning("drain timeout: aborted %d requests", aborted)
        deadline = loop.time() + ABORT_GRACE   # their handlers end the streams with an error event + [DONE]
        while state.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
    await runner.cleanup()
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(serve(args))
    except ValueError as exc:   # bad model path, bad keys file, bad sizes: say what and exit non-zero
        log.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
