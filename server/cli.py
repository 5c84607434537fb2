"""`python -m server` and `prescient serve [MODEL]`: load the model, serve the OpenAI API, drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import typing

from aiohttp import web

from loader.sizes import parse_size
from runtime.config import EngineConfig, field_docs, section_of_field
from server.config import ServerConfig

log = logging.getLogger("prescient.server")
ABORT_GRACE = 3.0
"""Seconds after the drain timeout for aborted requests' handlers to send their last event."""
SHUTDOWN_GRACE = 3.0
"""Seconds aiohttp waits for connections to close at the very end."""


def build_parser(prog: str = "python -m server") -> argparse.ArgumentParser:
    """One flag per field of ServerConfig and of every EngineConfig section, defaults taken from them."""
    p = argparse.ArgumentParser(prog=prog, description="Prescient OpenAI-compatible LLM server")
    _add_flags(p.add_argument_group("server"), ServerConfig, ServerConfig())
    engine = EngineConfig()
    for section in dataclasses.fields(EngineConfig):
        _add_flags(p.add_argument_group(section.name), section.default_factory, getattr(engine, section.name))
    # The older spelling of --no-enable-prefix-caching.
    p.add_argument(
        "--no-prefix-caching", dest="enable_prefix_caching", action="store_false", help=argparse.SUPPRESS
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe."""
    return EngineConfig().replace(**{name: getattr(args, name) for name in section_of_field()})


def server_config(args: argparse.Namespace) -> ServerConfig:
    defaults = ServerConfig()
    return ServerConfig(
        **{
            f.name: getattr(defaults, f.name) if getattr(args, f.name) is None else getattr(args, f.name)
            for f in dataclasses.fields(ServerConfig)
        }
    )


def _add_flags(group, cls: type, defaults) -> None:
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        help_text = docs.get(f.name, "") + ("" if default is None else f" (default: {default})")
        hint = hints[f.name]
        kinds = [hint] if typing.get_origin(hint) is list else typing.get_args(hint) or (hint,)
        kinds = [k for k in kinds if k is not type(None)]
        if kinds == [bool]:
            group.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
            continue
        if typing.get_origin(kinds[0]) is list:  # a repeatable flag
            group.add_argument(
                flag,
                dest=f.name,
                action="append",
                type=typing.get_args(kinds[0])[0],
                help=docs.get(f.name, ""),
            )
            continue
        convert = _size if f.metadata.get("size") else kinds[0]
        group.add_argument(
            flag,
            dest=f.name,
            type=convert,
            default=default,
            help=help_text,
            choices=f.metadata.get("choices"),
        )


def _size(text: str) -> int:
    """A byte size as the whole project reads it (loader.sizes): 1G = 1GiB = 2^30, 1GB = 10^9."""
    try:
        return parse_size(text, "size")
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1073741824, 512MiB, 1GiB)") from None


async def serve(args: argparse.Namespace) -> int:
    from runtime import EngineCoreClient
    from server.app import build_app
    from server.auth import api_keys

    keys = api_keys(args.api_keys, args.api_key or [])
    if args.metrics_auth and not keys:  # say so before minutes of model loading
        raise ValueError(
            "--metrics-auth needs --api-key or --api-keys: /metrics then asks for one of those keys"
        )
    if not 0 <= args.frontend_nice <= 19:
        raise ValueError(f"--frontend-nice: {args.frontend_nice} is not a nice value from 0 to 19")
    if args.engine_process:
        client = EngineCoreClient.launch(
            {"config": engine_config(args)}, max_waiting=args.max_waiting, log_level=args.log_level
        )
        log.info("engine core process %d: %s", client.pid, client.info.description)
        lower_priority(args.frontend_nice)  # the core, started above, keeps its own
    else:
        from runtime import AsyncEngine, Engine

        engine = Engine.from_pretrained(config=engine_config(args))
        log.info("%s", engine.describe())
        client = AsyncEngine(engine, max_waiting=args.max_waiting)
    app = build_app(
        client,
        api_keys=keys,
        max_body_bytes=args.max_body_bytes,
        served_model_name=args.served_model_name,
        throughput_log_seconds=args.throughput_log_seconds,
        metrics_auth=args.metrics_auth,
        tenant_metrics=args.tenant_metrics,
    )
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
        aborted = state.client.abort_all("the server is shutting down and the drain timeout passed")
        log.warning("drain timeout: aborted %d requests", aborted)
        deadline = loop.time() + ABORT_GRACE  # their handlers end the streams with an error event + [DONE]
        while state.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
    await runner.cleanup()
    log.info("stopped")
    return 0


def lower_priority(nice: int) -> None:
    """Every thread of this process to at least `nice` (Linux sets it per thread; threads started later
    inherit it from the thread that starts them). Never raises: a priority is not worth failing a start."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]  # elsewhere the call covers the process
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
        except OSError as exc:  # a thread that ended meanwhile, or no permission: keep going
            log.debug("--frontend-nice: thread %d: %s", tid, exc)
    if nice:
        log.info(
            "front end at nice %d (the engine core process at its own)", os.getpriority(os.PRIO_PROCESS, 0)
        )


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


def console_main(argv: list[str] | None = None) -> int:
    """The `prescient` console script: `prescient serve [MODEL] [flags of python -m server]`, as vLLM
    users run `vllm serve MODEL`; MODEL is what --model takes (a GGUF file or a Hugging Face directory)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        usage = "usage: prescient serve [MODEL] [--port PORT] [...]  (prescient serve --help: every flag)"
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(usage, file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    parser = build_parser(prog="prescient serve")
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="The model to serve (same as --model)")
    args = parser.parse_args(argv[1:])
    if args.model_tag is not None:
        if args.model not in (None, args.model_tag):
            parser.error(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree: give one")
        args.model = args.model_tag
    del args.model_tag
    return run(args)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return asyncio.run(serve(args))
    except ValueError as exc:  # bad model path, bad keys file, bad sizes: say what and exit non-zero
        log.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
