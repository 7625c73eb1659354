"""`nanoserve serve [MODEL]` runs the OpenAI-compatible server; `nanoserve generate "prompt"` prints a completion.

Parsing the flags imports neither torch nor the web stack: `--help` answers at once, and every
flag is checked before a weight is loaded.
"""

from __future__ import annotations

import argparse
import logging
import sys

from nanoserve import __version__
from nanoserve.defaults import LOG_FORMAT
from nanoserve.engine_flags import add_engine_flags, engine_kwargs
from nanoserve.lifetime import sigint_deferred
from nanoserve.serve_config import expand_config
from nanoserve.serve_setup import api_key_from_environment, serve_setup
from nanoserve.vllm_flags import add_vllm_serve_flags


class HelpWithDefaults(argparse.HelpFormatter):
    """Shows each flag's default, unless it is None or the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        if "default" in help_ or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return help_
        if action.default is False or action.default == []:
            return help_  # a switch that is off, or an empty list: nothing worth printing
        return f"{help_} (default: %(default)s)" if help_ else "(default: %(default)s)"


def _limit_args(p: argparse.ArgumentParser) -> None:
    from nanoserve.server.limits import ServerLimits  # torch-free, like the rest of the parser

    d = ServerLimits()
    p.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="413 for a larger request body, before it is read")
    p.add_argument("--max-request-json-values", type=int, default=d.max_request_json_values,
                   help="413 for a request body whose JSON holds more values than this, before it is parsed")
    p.add_argument("--max-seqs-per-request", type=int, default=d.max_seqs_per_request,
                   help="400 for a request of more prompts x n than this")
    p.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings, help="most strings in 'stop'")
    p.add_argument("--max-stop-string-chars", type=int, default=d.max_stop_string_chars,
                   help="longest string in 'stop'")
    p.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids,
                   help="most ids in 'stop_token_ids'")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections past this get 503 on every route but /health")
    p.add_argument("--timeout-keep-alive", type=float, default=d.timeout_keep_alive,
                   help="seconds an idle connection stays open after a response")
    p.add_argument("--timeout-headers", type=float, default=d.timeout_headers,
                   help="seconds a connection has to send complete request headers, from its first byte")
    p.add_argument("--timeout-body", type=float, default=d.timeout_body,
                   help="seconds a request has to send its whole body once its headers are complete, and "
                        "that a response may go with none of it read by the client")
    p.add_argument("--timeout-grammar-compile", type=float, default=d.timeout_grammar_compile,
                   help="seconds a structured-output spec may take to compile before the request gets a 400")
    p.add_argument("--max-undelivered-mb", type=float, default=d.max_undelivered_mb,
                   help="MiB of output held for clients that have not read it, over all connections; past it "
                        "the responses furthest behind are aborted and their connections closed")



def build_parser() -> argparse.ArgumentParser:
    # torch-free, like the rest of the parser
    from nanoserve.server.reasoning import REASONING_PARSERS
    from nanoserve.server.tool_parsers import TOOL_PARSERS

    parser = argparse.ArgumentParser(prog="nanoserve", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"nanoserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server", formatter_class=HelpWithDefaults)
    serve.add_argument("model", nargs="?", default=None,
                       help="Hugging Face model folder, or Hub repository id such as Qwen/Qwen3-0.6B "
                            "(default: the bundled tiny model)")
    serve.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                       help="the same as the MODEL argument, as vLLM's `serve --model` takes it")
    serve.add_argument("--config", default=None, metavar="FILE.yaml",
                       help="flags from a YAML file of flag names and values (vLLM's --config); the command line's "
                            "own flags win")
    serve.add_argument("--host", default="0.0.0.0", help="address to listen on (127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--root-path", default="", metavar="PREFIX",
                       help="the path prefix of a proxy that routes to this server by path (/llm): requests are served "
                            "with it or without it, and the API docs name it")
    serve.add_argument("--uds", default=None, metavar="PATH",
                       help="listen on this Unix domain socket instead of --host and --port")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="names clients use in 'model' (default: the MODEL argument as given)")
    serve.add_argument("--api-key", default=api_key_from_environment(),
                       help="require 'Authorization: Bearer KEY' on every route but /health "
                            "(default: $NANOSERVE_API_KEY, else vLLM's $VLLM_API_KEY)")
    serve.add_argument("--max-queue-len", type=int, default=1024,
                       help="sequences (prompts x n) that may wait beside the --max-num-seqs running; "
                            "past that a request gets 503 with a Retry-After from the queue's drain rate")
    serve.add_argument("--allowed-origins", nargs="+", default=[],
                       help="enable CORS for these origins ('*' for any); off by default")
    serve.add_argument("--allowed-methods", nargs="+", default=["*"], help="CORS: the methods browsers may use")
    serve.add_argument("--allowed-headers", nargs="+", default=["*"], help="CORS: the headers browsers may send")
    serve.add_argument("--allow-credentials", action="store_true",
                       help="CORS: browsers may send cookies and Authorization to the allowed origins")
    serve.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="no access line per request from uvicorn (nanoserve's own request lines stay)")
    serve.add_argument("--enable-force-include-usage", action="store_true",
                       help="every streamed response ends with its usage, as if stream_options.include_usage were set")
    serve.add_argument("--api-server-count", "-asc", type=int, default=1,
                       help="front-end processes (HTTP, tokenizing, detokenizing, SSE) sharing the port and the one "
                            "engine core: more when the front end's one core cannot keep up with the GPU")
    serve.add_argument("--stream-interval", type=int, default=1,
                       help="tokens a streamed choice gathers before the server sends them in one event (its first "
                            "and last tokens go at once): fewer, larger events cost the server less under load")
    serve.add_argument("--metrics-prefix", default="nanoserve", choices=["nanoserve", "vllm"],
                       help="the prefix of every /metrics name: vllm names them as vLLM does (vllm:num_requests_waiting, "
                            "vllm:kv_cache_usage_perc, ...) for autoscalers and routers that read vLLM's")
    serve.add_argument("--enable-request-id-headers", action="store_true",
                       help="every response carries X-Request-Id: the client's own header, else a new id")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds that requests in flight get to finish after SIGTERM")
    serve.add_argument("--chat-template", default=None,
                       help="Jinja chat template (a file, or the template itself) instead of the tokenizer's")
    serve.add_argument("--generation-config", default="auto",
                       help="auto: default temperature, top_p, top_k, min_p and repetition_penalty from the model's "
                            "generation_config.json; vllm: ignore that file; or a folder holding one")
    serve.add_argument("--override-generation-config", default=None, metavar="JSON",
                       help="default sampling settings over --generation-config's, e.g. '{\"temperature\": 0.6}' "
                            "(temperature, top_p, top_k, min_p, repetition_penalty); a request's own fields win")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="let the model decide to call tools (tool_choice auto); needs --tool-call-parser")
    serve.add_argument("--tool-call-parser", default=None, choices=list(TOOL_PARSERS),
                       help="the model's tool-call format: hermes (Qwen2.5, Qwen3), llama3_json (Llama 3.1/3.2), "
                            "mistral")
    serve.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                       help="return <think>...</think> as reasoning (and reasoning_content), apart from content")
    serve.add_argument("--engine-death-grace-period", type=float, default=30.0,
                       help="seconds that /health answers 503 after the engine died, before the server exits "
                            "non-zero (so that a supervisor restarts it)")
    serve.add_argument("--engine-stall-timeout", type=float, default=60.0,
                       help="seconds without a word from the engine core (it sends a heartbeat every second, "
                            "busy or idle) after which /health answers 503: a step that never returns")
    serve.add_argument("--disable-log-requests", action="store_true", help="no log line per finished request")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="no line of engine statistics every 10 s while there is work")
    serve.add_argument("--disable-fastapi-docs", action="store_true",
                       help="no /docs, /redoc or /openapi.json (404 instead)")
    serve.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help='logprobs name tokens "token_id:N" unless a request sets return_tokens_as_token_ids')
    serve.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this PEM certificate (chain)")
    serve.add_argument("--ssl-keyfile", default=None, help="the certificate's PEM private key, unencrypted")
    serve.add_argument("--ssl-ca-certs", default=None, help="CA certificates that client certificates must chain to")
    serve.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                       help="client certificates: 0 not asked for, 1 optional, 2 required (ssl.CERT_*)")
    _limit_args(serve)
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="least severe log lines shown")
    serve.add_argument("--uvicorn-log-level", default=None,
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="least severe of uvicorn's own lines, its access lines among them (default: --log-level)")
    add_engine_flags(serve)
    add_vllm_serve_flags(serve)

    gen = sub.add_parser("generate", help="complete one prompt offline and print the text",
                         formatter_class=HelpWithDefaults)
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None,
                     help="Hugging Face model folder or Hub repository id (default: the bundled tiny model)")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    add_engine_flags(gen)

    # no -h of its own: `bench throughput --help` belongs to the benchmark (`bench --help` is handled in main)
    bench = sub.add_parser("bench", help="run a benchmark: throughput (offline) or serving (HTTP load)",
                           add_help=False, usage="nanoserve bench {throughput,serving} [--help | FLAGS ...]")
    bench.add_argument("kind", choices=["throughput", "serving"])
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own flags (see --help)")
    return parser



def _bench(args: argparse.Namespace) -> None:
    from importlib import import_module

    import_module(f"nanoserve.benchmarks.{args.kind}").main(args.args)


def _generate(args: argparse.Namespace) -> None:
    from nanoserve.model_source import resolve_model

    kwargs = engine_kwargs(args, args.model)
    # the model first, before torch loads: a wrong path is refused at once
    kwargs["model"] = resolve_model(kwargs["model"], args.revision, args.download_dir, args.trust_remote_code)
    with sigint_deferred():   # Ctrl-C inside torch's import could be swallowed or leave it half-imported
        from nanoserve.engine.llm import LLM
        from nanoserve.sampling_params import SamplingParams

    # every flag is checked before the weights load: SamplingParams here, EngineConfig first thing in LLM
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    with LLM(**kwargs) as llm:
        print(llm.generate(args.prompt, params, use_tqdm=False)[0].text)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        with sigint_deferred():   # Ctrl-C while the parser's modules load: "interrupted", not a traceback
            parser = build_parser()
        if argv[:2] in (["bench", "-h"], ["bench", "--help"]):
            bench = parser._subparsers._group_actions[0].choices["bench"]  # noqa: SLF001 - argparse keeps it there
            bench.print_help()
            print("\nEach benchmark has its own flags: nanoserve bench throughput --help, nanoserve bench serving --help")
            return
        if argv[:1] == ["serve"]:
            argv = ["serve", *expand_config(argv[1:], parser._subparsers._group_actions[0].choices["serve"])]  # noqa: SLF001
        args = parser.parse_args(argv)
        logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                            format=LOG_FORMAT)
        if args.command == "serve":
            with sigint_deferred():   # the checks, imports and config; serving handles Ctrl-C itself
                start = serve_setup(args, parser)
            start()
        elif args.command == "bench":
            _bench(args)
        else:
            _generate(args)
    except ValueError as exc:  # a bad flag value, caught by EngineConfig or SamplingParams
        print(f"nanoserve: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C while loading (serve: before serving began), during generate or a benchmark
        print("nanoserve: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    sys.exit(main())
