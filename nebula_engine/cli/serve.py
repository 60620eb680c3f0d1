"""``nebula-engine serve``: the OpenAI-compatible HTTP API over one local engine, a local cluster, or one peer of a
cluster spread over machines."""

from __future__ import annotations

from pathlib import Path

import click

from nebula_engine.cli.options import DEVICE, DTYPE, check_local_model
from nebula_engine.cluster.control.policy_names import POLICY_NAMES
from nebula_engine.engine.sampling_params import MAX_LOGPROBS
from nebula_engine.server.limits import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                                         DEFAULT_MAX_REQUEST_BYTES)
from nebula_engine.server.tool_parsers import TOOL_PARSERS


@click.command()
@click.option("--model", help="Checkpoint directory, .gguf file, catalog name (qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, "
                               "smollm2) or Hugging Face id [default: qwen2.5-coder-0.5b].")
@click.option("--download", is_flag=True, help="Fetch a catalog model that is not downloaded yet.")
@click.option("--served-model-name", help="The name clients put in 'model' (default: the --model value).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the HTTP API listens on: loopback unless you open it (e.g. 0.0.0.0) on purpose.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--pic-backend", help="PIC backend spec for <pic> segments of requests that name none, e.g. "
                                    "'epic' or 'cacheblend:ratio=0.3'; 'none': PIC off (default: auto).")
@click.option("--dtype", type=DTYPE, default="float32", show_default=True)
@click.option("--device", type=DEVICE, default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--attention-backend", default="auto", show_default=True,
              help="torch | flashinfer | auto (flashinfer on CUDA when installed).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds requests that carry no seed.")
@click.option("--page-size", type=click.IntRange(min=1), default=16, show_default=True, help="Tokens per KV page.")
@click.option("--num-pages", type=click.IntRange(min=1), help="KV pool size (default: from a 1 GiB budget).")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True)
@click.option("--host-cache-tokens", type=click.IntRange(min=0), help="Host-memory tier below the KV pool.")
@click.option("--disk-cache-tokens", type=click.IntRange(min=0), help="Disk tier below host memory.")
@click.option("--disk-cache-path", type=click.Path(file_okay=False),
              help="The disk tier's directory (what `nebula-engine prefill` warmed); per peer in a local cluster.")
@click.option("--max-model-len", type=click.IntRange(min=2), help="Prompt + output tokens per request.")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=2048, show_default=True)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@click.option("--prefill-workers", type=click.IntRange(min=1), default=None,
              help="Start a local cluster of this many prefill peers (HTTP on --port, --port+1, ...).")
@click.option("--decode-workers", type=click.IntRange(min=0), default=1, show_default=True,
              help="Decode peers of the local cluster (0: prefill peers also decode).")
@click.option("--policy", type=click.Choice(POLICY_NAMES), default="nebula", show_default=True,
              help="Cluster routing policy.")
@click.option("--cluster", "cluster_file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="Run ONE peer of the cluster described by this spec JSON (needs --name).")
@click.option("--name", help="This peer's name in --cluster.")
@click.option("--role", type=click.Choice(["prefill", "decode"]), help="Checked against the peer's role in --cluster.")
@click.option("--etcd", help="HOST:PORT of an etcd to elect the leader with (default: embedded Raft).")
@click.option("--api-key", envvar="NEBULA_API_KEY", show_envvar=True,
              help="Every request must send 'Authorization: Bearer KEY' (401 otherwise), on every peer of a "
                   "cluster; only /health and /metrics (see --protect-metrics) stay open. Prefer the environment variable: a command line is "
                   "visible to every local user.")
@click.option("--max-request-bytes", type=click.IntRange(min=1), default=DEFAULT_MAX_REQUEST_BYTES, show_default=True,
              help="A larger request body is refused with 413 before it is parsed (every peer of a cluster).")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_HEADER_TIMEOUT_S,
              show_default=True, help="Seconds a client may take to send a request's line and headers; then the "
                                      "connection is closed.")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_BODY_TIMEOUT_S,
              show_default=True, help="Seconds a client may take to send a request's whole body (408 after).")
@click.option("--timeout-keep-alive", type=click.IntRange(min=1), default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
              show_default=True, help="Seconds an idle keep-alive connection stays open (uvicorn's option).")
@click.option("--max-request-output-tokens", type=click.IntRange(min=1),
              help="Most tokens one request may ask generated per prompt, n x max_tokens (400 above; default: the "
                   "model's context length, what one n=1 request can cost).")
@click.option("--max-request-prompt-tokens", type=click.IntRange(min=1),
              help="Most prompt tokens one request may ask prefilled per prompt, n x prompt length (400 above; "
                   "default: the model's context length).")
@click.option("--protect-metrics", is_flag=True, help="/metrics needs the --api-key too (only /health stays open).")
@click.option("--port-range", help="LOW-HIGH: every port a local cluster (--prefill-workers) opens, internal ones "
                                   "included, is drawn from this range [default: 10000 up to the kernel's "
                                   "ephemeral ports].")
@click.option("--tool-call-parser", type=click.Choice(sorted(TOOL_PARSERS)),
              help="Format of tool calls in the model's output (default: recognised from its chat template).")
@click.option("--enable-auto-tool-choice", is_flag=True,
              help="Let the model decide when to call tools (tool_choice auto, vLLM's flag); needs a tool call "
                   "format: --tool-call-parser, or a chat template whose format is recognised (which turns it on "
                   "by itself).")
@click.option("--chat-template", help="Chat template replacing the model's: a file, or the Jinja text itself "
                                      "(as vLLM's flag; on every peer of a cluster).")
@click.option("--max-logprobs", type=click.IntRange(min=0), default=MAX_LOGPROBS, show_default=True,
              help="The most logprobs per token a request may ask (logprobs, top_logprobs, prompt_logprobs).")
@click.option("--structured-outputs-disable-any-whitespace", "disable_any_whitespace", is_flag=True,
              help="Constrained JSON (response_format, forced tool calls) without free whitespace (vLLM's option).")
@click.option("--cluster-secret", envvar="NEBULA_CLUSTER_SECRET", show_envvar=True,
              help="Secret shared by a cluster's peers (>= 16 characters); required when they span machines. "
                   "Prefer the variable or --cluster-secret-file: `ps` shows command lines. A local cluster "
                   "draws one itself.")
@click.option("--cluster-secret-file", type=click.Path(dir_okay=False, exists=True),
              help="A file (mode 0600) holding the cluster secret.")
@click.option("--peer-timeout", type=click.FloatRange(min=0, min_open=True), default=3.0, show_default=True,
              help="Seconds of silence after which a cluster peer counts as dead.")
@click.option("--failover-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="A request whose peer died is re-run, or failed, within this many seconds of its last sign of "
                   "life.")
@click.option("--etcd-ca-cert", type=click.Path(dir_okay=False, exists=True), help="CA that signed etcd's certificate.")
@click.option("--etcd-cert", type=click.Path(dir_okay=False, exists=True), help="Client certificate for etcd.")
@click.option("--etcd-key", type=click.Path(dir_okay=False, exists=True), help="Key of --etcd-cert.")
@click.option("--etcd-user", help="etcd user (its password in $NEBULA_ETCD_PASSWORD).")
def serve(model, served_model_name, host, port, log_level, prefill_workers, decode_workers, policy, cluster_file,
          name, role, etcd, api_key, max_request_bytes, tool_call_parser, disable_any_whitespace,
          enable_auto_tool_choice, max_logprobs, **options):
    """Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.

    One engine by default; --prefill-workers N starts a whole local cluster (one process per peer, no external
    service); --cluster SPEC --name X runs one peer of a cluster spread over machines."""
    if api_key is not None and not api_key.strip():
        raise click.BadParameter("the API key is empty (check NEBULA_API_KEY)", param_hint="--api-key")
    cluster_options = {key: options.pop(key) for key in CLUSTER_OPTIONS}
    guard_options = {key: options.pop(key) for key in GUARD_OPTIONS}
    engine_options = options
    if cluster_file is not None or prefill_workers is not None:
        if tool_call_parser is not None or disable_any_whitespace or enable_auto_tool_choice \
                or max_logprobs != MAX_LOGPROBS:
            raise click.UsageError("--tool-call-parser, --enable-auto-tool-choice, --max-logprobs and "
                                   "--structured-outputs-disable-any-whitespace are for one engine (a cluster "
                                   "recognises the tool-call format from the chat template)")
        _check_cluster_guards(guard_options, prefill_workers)
        settings = _peer_settings(api_key, max_request_bytes, **cluster_options)
        _serve_cluster(model, served_model_name, host, port, log_level, prefill_workers, decode_workers, policy,
                       cluster_file, name, role, etcd, engine_options, settings,
                       port_range=_port_range(guard_options["port_range"]))
        return
    if guard_options["port_range"] is not None:
        raise click.UsageError("--port-range is for a local cluster (--prefill-workers): one engine listens on --port")
    import uvicorn

    from nebula_engine.config import DEFAULT_MODEL
    from nebula_engine.server.api import build_app

    _check_listen([(host, port, "--port")])
    engine = _start_engine(model, engine_options)
    name = served_model_name or model or DEFAULT_MODEL
    from nebula_engine.server.tool_parsers import parser_for_template

    if enable_auto_tool_choice and tool_call_parser is None and parser_for_template(engine.tokenizer.chat_template) \
            is None:
        engine.shutdown()
        raise click.UsageError("--enable-auto-tool-choice needs --tool-call-parser: this model's chat template "
                               "writes tool calls in no format known here")
    app = build_app(engine, name, api_key=api_key, max_request_bytes=max_request_bytes,
                    tool_call_parser=tool_call_parser, disable_any_whitespace=disable_any_whitespace,
                    max_logprobs=max_logprobs, limits=_client_limits(guard_options),
                    open_metrics=not guard_options["protect_metrics"])
    click.echo(f"serving {name!r} (max_model_len {engine.max_model_len}) on http://{host}:{port}", err=True)
    _warn_if_unguarded(host, api_key)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, **_uvicorn_guards(guard_options))
    finally:
        engine.shutdown()


def _check_listen(addresses) -> None:
    """Each ``(host, port, flag)`` can be listened on now: a busy port fails before any model loads."""
    from nebula_engine.ports import PortUnavailable, check_listen

    try:
        for host, port, flag in addresses:
            check_listen(host, port, flag)
    except PortUnavailable as exc:
        raise click.ClickException(str(exc)) from exc


def _peer_addresses(spec, peer, spec_file) -> list[tuple[str, int, str]]:
    """What one peer of a cluster spec listens on: HTTP, the control channel and (without etcd) Raft."""
    return [(host, port, f"{peer.name}'s {kind} in {spec_file}") for host, port, kind in spec.listen_addresses(peer.name)]


CLUSTER_OPTIONS = ("cluster_secret", "cluster_secret_file", "peer_timeout", "failover_timeout", "etcd_ca_cert",
                   "etcd_cert", "etcd_key", "etcd_user")


def _peer_settings(api_key, max_request_bytes, cluster_secret, cluster_secret_file, peer_timeout, failover_timeout, etcd_ca_cert,
                   etcd_cert, etcd_key, etcd_user):
    import os

    from nebula_engine.cluster.runtime.auth import cluster_secret as read_cluster_secret
    from nebula_engine.cluster.runtime.election import ETCD_PASSWORD_ENV, EtcdAccess
    from nebula_engine.cluster.runtime.spec import PeerSettings

    try:
        secret = read_cluster_secret(flag=cluster_secret, file=cluster_secret_file)
        access = EtcdAccess(etcd_ca_cert, etcd_cert, etcd_key, etcd_user, os.environ.get(ETCD_PASSWORD_ENV) or None)
        return PeerSettings(secret, api_key, access, peer_timeout, failover_timeout, max_request_bytes)
    except ValueError as exc:  # SecretError too
        raise click.UsageError(str(exc)) from exc


def _start_engine(model: str | None, engine_options: dict):
    from nebula_engine.config import DEFAULT_MODEL, EngineConfig
    from nebula_engine.engine.async_engine import AsyncLLMEngine

    check_local_model(model)
    options = {k: v for k, v in engine_options.items() if v is not None}
    if options.get("pic_backend") == "none":
        options["pic_backend"] = None
    try:
        return AsyncLLMEngine.from_config(EngineConfig.create(model or DEFAULT_MODEL, **options))
    except (OSError, ValueError, ImportError) as exc:  # a missing checkpoint or gguf extra, a bad option value
        raise click.UsageError(f"cannot start the engine: {exc}") from exc


def _serve_cluster(model, served_model_name, host, port, log_level, prefill_workers, decode_workers, policy,
                   cluster_file, name, role, etcd, engine_options, settings, port_range=None) -> None:
    import asyncio
    import logging
    import signal
    import threading

    from dataclasses import replace

    from nebula_engine.cluster.runtime.auth import SecretError
    from nebula_engine.cluster.runtime.launcher import LocalCluster, local_spec
    from nebula_engine.cluster.runtime.peer import Peer
    from nebula_engine.cluster.runtime.spec import ClusterSpec
    from nebula_engine.config import DEFAULT_MODEL, resolve_model

    options = {k: v for k, v in engine_options.items() if v is not None}
    if options.get("pic_backend") == "none":
        options["pic_backend"] = None
    if not model:
        served_model_name = served_model_name or DEFAULT_MODEL
    try:
        model = resolve_model(model or DEFAULT_MODEL, download=bool(options.get("download")))
    except (FileNotFoundError, RuntimeError) as exc:  # not downloaded, or the download failed
        raise click.UsageError(str(exc)) from exc
    local = Path(model).expanduser()
    model = str(local.resolve()) if local.exists() else model  # peers may run elsewhere: an absolute path
    if cluster_file is not None:
        if not name:
            raise click.UsageError("--cluster needs --name (this peer's name in the spec)")
        try:
            spec = ClusterSpec.from_json(cluster_file.read_text())
            spec = replace(spec, etcd=etcd) if etcd else spec
            peer = spec.peer(name)
        except (ValueError, KeyError, TypeError) as exc:
            raise click.UsageError(f"bad cluster spec {cluster_file}: {exc}") from exc
        if role is not None and role != peer.role:
            raise click.UsageError(f"--role {role} but {name} is a {peer.role} peer in {cluster_file}")
        logging.basicConfig(level=log_level.upper())
        try:
            runner = Peer(spec, name, options, model, served_model_name or model, settings)
        except SecretError as exc:
            raise click.UsageError(str(exc)) from exc
        _check_listen(_peer_addresses(spec, peer, cluster_file))  # Peer() checked the settings; run() loads the model
        _warn_if_unguarded(peer.api_host, settings.api_key)
        asyncio.run(runner.run())
        return
    try:
        spec = local_spec(prefill_workers, decode_workers, host, port, policy, etcd, port_range=port_range)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    _warn_if_unguarded(host, settings.api_key)
    _check_listen([(peer.api_host, peer.http_port, "--port (a local cluster listens on --port, --port+1, ...)")
                   for peer in spec.peers])
    cluster = LocalCluster(model, spec, options, served_model_name or model, log_level=log_level, settings=settings,
                           keep_http_ports=port != 0, port_range=port_range)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster.start()
        click.echo(f"cluster of {prefill_workers} prefill + {decode_workers} decode peers ({policy}), "
                   f"leader {cluster.leader()}; logs in {cluster.log_dir}", err=True)
        for peer_name, url in cluster.urls.items():
            click.echo(f"  {peer_name}: {url}", err=True)
        stop.wait()
    finally:
        cluster.stop()


GUARD_OPTIONS = ("header_timeout", "body_timeout", "timeout_keep_alive", "max_request_output_tokens",
                 "max_request_prompt_tokens", "protect_metrics", "port_range")
ONE_ENGINE_GUARDS = {"header_timeout": DEFAULT_HEADER_TIMEOUT_S, "body_timeout": DEFAULT_BODY_TIMEOUT_S,
                     "timeout_keep_alive": DEFAULT_KEEP_ALIVE_TIMEOUT_S, "max_request_output_tokens": None,
                     "max_request_prompt_tokens": None, "protect_metrics": False}


def _client_limits(guard_options: dict):
    from nebula_engine.server.limits import ClientLimits

    return ClientLimits(guard_options["body_timeout"], guard_options["max_request_output_tokens"],
                        guard_options["max_request_prompt_tokens"])


def _uvicorn_guards(guard_options: dict) -> dict:
    """uvicorn's settings for slow clients: the request-head deadline (its own protocol) and the idle keep-alive."""
    from nebula_engine.server.guards import header_timeout_protocol

    return {"http": header_timeout_protocol(guard_options["header_timeout"]),
            "timeout_keep_alive": guard_options["timeout_keep_alive"]}


def _check_cluster_guards(guard_options: dict, prefill_workers) -> None:
    """A cluster's peers apply the default client timeouts and cost caps; other values are for one engine."""
    changed = [f"--{key.replace('_', '-')}" for key, default in ONE_ENGINE_GUARDS.items()
               if guard_options[key] != default]
    if changed:
        raise click.UsageError(f"{', '.join(changed)}: for one engine; a cluster's peers apply the defaults")
    if guard_options["port_range"] is not None and prefill_workers is None:
        raise click.UsageError("--port-range is for a local cluster (--prefill-workers); a --cluster spec names "
                               "its ports")


def _port_range(text: str | None):
    from nebula_engine.cluster.runtime.launcher import PortRange

    if text is None:
        return None
    try:
        return PortRange.parse(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--port-range") from exc


def _warn_if_unguarded(host: str, api_key: str | None) -> None:
    """Say so, loudly, when an HTTP API anyone on the network can reach runs without an API key."""
    import ipaddress

    if api_key is not None:
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        loopback = False
    if not loopback:
        click.echo(f"WARNING: serving on {host} without --api-key: anyone who can reach this address can run "
                   "requests on this engine and read every route. Set NEBULA_API_KEY (or --api-key), "
                   "or listen on 127.0.0.1.", err=True)
