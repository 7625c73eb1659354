"""`nanoserve serve`: its flags checked against one another, the model and its files, before the web
stack and torch load; then the server's settings and the engine's config, and the call that serves."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from nanoserve.defaults import DEFAULT_MODEL, ENGINE_HEARTBEAT_S, MAX_API_SERVERS
from nanoserve.engine_flags import engine_kwargs
from nanoserve.vllm_flags import check_vllm_serve_flags, log_requests

if TYPE_CHECKING:
    from nanoserve.server.limits import ServerLimits


def _limits(args: argparse.Namespace) -> ServerLimits:
    from nanoserve.server.limits import ServerLimits

    # each limit's flag has the field's name
    return ServerLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)})


# where the key comes from when --api-key is not given, the first one set winning: a vLLM
# deployment that sets its own variable must not find its server open
API_KEY_VARIABLES = ("NANOSERVE_API_KEY", "VLLM_API_KEY")


def _api_key_variable() -> str | None:
    """The variable the key comes from when --api-key is not given: the first one set, and not empty."""
    return next((name for name in API_KEY_VARIABLES if os.environ.get(name)), None)


def api_key_from_environment() -> str | None:
    variable = _api_key_variable()
    return os.environ[variable] if variable else None


def serve_setup(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Callable[[], None]:
    """Check `serve`'s flags and model, load the server and the engine's config; the call that serves."""
    # the server sets it for front ends that share a port (server/api_servers.py); inherited, it put
    # prometheus_client in its multiprocess mode: files left in that folder, a traceback where it is none
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    # torch-free: a bad flag, file or model is refused before the web stack and torch load (seconds)
    from nanoserve.generation_defaults import generation_overrides, sampling_defaults
    from nanoserve.server.tool_parsers import TOOL_PARSERS
    from nanoserve.server.tls import tls_files
    from nanoserve.model_source import resolve_model
    from nanoserve.checkpoint_quantization import check_quantization_flag
    from nanoserve.engine.early_start import EarlyEngineProcess
    from nanoserve.server.listen import bind_socket

    if args.max_queue_len < 1:
        parser.error(f"--max-queue-len must be at least 1, got {args.max_queue_len}")
    if not 1 <= args.api_server_count <= MAX_API_SERVERS:
        parser.error(f"--api-server-count must be 1-{MAX_API_SERVERS} processes, got {args.api_server_count}")
    if args.root_path and (not args.root_path.startswith("/") or not args.root_path.isprintable()
                           or any(c in args.root_path for c in " ?#")):
        parser.error(f"--root-path must be a URL path that starts with '/' (such as /llm), got {args.root_path!r}")
    args.root_path = args.root_path.rstrip("/")
    if not 1 <= args.stream_interval <= 1024:
        parser.error(f"--stream-interval must be 1-1024 tokens, got {args.stream_interval}")
    if not 0 <= args.port <= 65535:   # else bind() raised OverflowError, traceback and all
        parser.error(f"--port must be in 0-65535, got {args.port}")
    if args.uds == "":   # Linux binds "" to a random abstract address: served where no client finds it
        parser.error("--uds needs the path of the socket file to listen on")
    if args.api_key is not None and (not args.api_key.strip() or not args.api_key.isascii()):
        # an empty key (an unset variable spliced in) would leave every route open without a word
        variable = _api_key_variable()
        given = f"${variable}" if variable and args.api_key == os.environ[variable] else "--api-key"
        parser.error(f"{given} is empty, blank or not ASCII: give a key of printable ASCII characters, "
                     "or leave it out to serve without one")
    for name in args.served_model_name or []:
        if not name.strip() or not name.isprintable():   # /v1/models listed an id no client could send
            parser.error(f"--served-model-name {name!r} is not a name: give printable text, not only spaces")
    if args.served_model_name:   # a name given twice was listed twice in /v1/models
        args.served_model_name = list(dict.fromkeys(args.served_model_name))
    for name in API_KEY_VARIABLES:
        if args.api_key is None and os.environ.get(name) == "":
            print(f"nanoserve: warning: {name} is set but empty: serving without an API key", file=sys.stderr)
    _check_seconds(args, parser)
    _check_cors(args, parser)
    check_vllm_serve_flags(args, parser)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_PARSERS)})")
    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            parser.error(f"the model is given twice, as {args.model!r} and --model {args.model_flag!r}: give one")
        args.model = args.model_flag
    try:
        overrides = generation_overrides(args.override_generation_config)
        tls = tls_files(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)
        kwargs = engine_kwargs(args, args.model)
        # a Hub repository is fetched now (the flags above are checked first: a download takes minutes)
        kwargs["model"] = resolve_model(kwargs["model"], args.revision, args.download_dir, args.trust_remote_code)
        check_quantization_flag(kwargs["model"], args.quantization)
        # the model folder's defaults too: a bad value there would fail every request that leaves it out
        sampling_defaults(kwargs["model"], args.generation_config, overrides)
    except ValueError as exc:
        parser.error(str(exc))
    sock = bind_socket(args.host, args.port, args.uds)   # a busy port is refused before anything slow starts
    # the engine core's process imports torch and the model code while this one imports the web stack
    early = EarlyEngineProcess()
    from nanoserve.server.app import HTTPOptions, serve  # the web stack loads only for `serve`
    from nanoserve.server.connections import raise_open_file_limit
    from nanoserve.server.state import ServerSettings

    names = args.served_model_name or [args.model or os.path.basename(DEFAULT_MODEL)]
    settings = ServerSettings(served_model_names=names, api_key=args.api_key,
                              allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                              allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                              force_include_usage=args.enable_force_include_usage,
                              stream_interval=args.stream_interval, metrics_prefix=args.metrics_prefix,
                              request_id_headers=args.enable_request_id_headers, root_path=args.root_path,
                              chat_template=_chat_template(args.chat_template),
                              log_requests=log_requests(args), log_stats=not args.disable_log_stats,
                              api_docs=not args.disable_fastapi_docs,
                              return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                              engine_death_grace_s=args.engine_death_grace_period,
                              engine_stall_timeout_s=args.engine_stall_timeout, limits=_limits(args),
                              generation_config=args.generation_config, generation_overrides=overrides,
                              tool_call_parser=args.tool_call_parser,
                              enable_auto_tool_choice=args.enable_auto_tool_choice,
                              reasoning_parser=args.reasoning_parser, response_role=args.response_role)
    from nanoserve.config import EngineConfig
    from nanoserve.cpu_threads import cpu_compute_threads

    raise_open_file_limit(settings.limits.max_connections)
    # on the CPU the front end (HTTP, tokenizing, SSE) keeps a core of its own beside the engine
    threads = cpu_compute_threads(args.tensor_parallel_size, reserved=args.api_server_count)
    options = HTTPOptions(args.host, args.port, args.max_queue_len, args.shutdown_timeout, args.log_level, tls,
                          args.uvicorn_log_level, not args.disable_uvicorn_access_log, args.uds)
    config = EngineConfig(**kwargs, cpu_threads=threads)
    return functools.partial(serve, config, settings, options, args.api_server_count, early, sock)


def _check_seconds(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The serve flags that are durations; each misbehaved only later, once serving."""
    shortest_stall = 3 * ENGINE_HEARTBEAT_S
    if not args.engine_stall_timeout >= shortest_stall:
        # idle heartbeats come up to 2 s apart: /health answered 503 engine_stalled for a healthy engine
        parser.error(f"--engine-stall-timeout must be at least {shortest_stall:g} seconds (the engine core's "
                     f"heartbeat comes every {ENGINE_HEARTBEAT_S:g} s), got {args.engine_stall_timeout}")
    if not 0 <= args.engine_death_grace_period < math.inf:
        # nan or inf: the server never exited after its engine died, so no supervisor restarted it
        parser.error(f"--engine-death-grace-period must be a finite number of seconds >= 0, "
                     f"got {args.engine_death_grace_period}")
    if not args.shutdown_timeout >= 0:
        # nan: the drain on SIGTERM crashed with a traceback and cut every request at once
        parser.error(f"--shutdown-timeout must be a number of seconds >= 0 (inf: wait for every request), "
                     f"got {args.shutdown_timeout}")


def _check_cors(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """CORS values are sent in, or matched against, headers: one a header cannot carry (a stray
    newline, a space, a character past latin-1) failed every preflight with an empty reply."""
    for flag in ("allowed_origins", "allowed_methods", "allowed_headers"):
        for value in getattr(args, flag):
            if not value or not value.isascii() or not value.isprintable() or " " in value:
                parser.error(f"--{flag.replace('_', '-')} {value!r} is not a header value: give printable ASCII "
                             "without spaces (an origin's host in its punycode form, xn--...)")


def _chat_template(value: str | None) -> str | None:
    """The template text: read from a file when `value` names one (as vLLM's flag does). ValueError
    for text that cannot be a template or does not compile: the server started, and every chat
    request got a 400 that blamed its messages."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            value = f.read()
    elif not any(mark in value for mark in "{}\n"):   # vLLM's rule: no Jinja in it, so a path
        raise ValueError(f"--chat-template {value!r} is not a file, and no template (it has no Jinja in it)")
    from nanoserve.server.conversation import template_compile_error

    if (error := template_compile_error(value)) is not None:
        raise ValueError(f"--chat-template is not a Jinja template that compiles: {error}")
    return value
