"""Drive the real clients teams point at vLLM against a real ``nebula-engine serve``, and say what each did.

The server runs on a free 127.0.0.1 port (stopped by its pid at the end). Each client runs in a subprocess of its
own, in the Python environment that has the clients, so one that fails does not stop the others:

- lm-evaluation-harness, ``local-completions`` on a 20-question multiple-choice task written here (loglikelihood:
  token-id prompts with ``echo`` and ``logprobs``), with the served model's tokenizer saved here;
- guidellm, its default streaming chat benchmark (``stream_options`` with ``include_usage`` and
  ``continuous_usage_stats``) on synthetic prompts, the same tokenizer;
- LangChain, ``ChatOpenAI(...).bind_tools([get_weather])``: the parsed ``tool_calls``, the tool result sent back,
  and the same call streamed;
- the OpenAI Agents SDK, an ``Agent`` with one function tool run to completion over ``/v1/responses`` (plain and
  streamed) and over the chat completions model.

Every request's status is read from the server's ``nebula_requests_total`` before and after each client. Nothing is
downloaded: the task data, the tokenizer and the model are local (``HF_HUB_OFFLINE=1`` for the clients).

Install the clients in an environment of their own (they pin their own versions of shared packages; the CPU torch
pin keeps pip from pulling the multi-GB CUDA build):

    python3.11 -m venv ../clients-venv
    ../clients-venv/bin/pip install torch==2.13.0 'lm-eval' 'guidellm' 'langchain-openai' 'openai-agents'
    # (the same list is the package's optional extra: pip install torch==2.13.0 -e '.[clients]')

Run, from the repository root, with this checkout's environment:

    python tools/client_check.py --clients-python ../clients-venv/bin/python [--model NAME] [--cluster] [--write-docs]

``--cluster`` runs every client a second time against a local cluster (``serve --prefill-workers 2
--decode-workers 1``: the API on the router's peer). ``--write-docs`` writes ``docs/results/clients.md`` (machine,
command, one table per server). The file is also what each client
subprocess runs (``client_check.py client NAME ...``): that part imports only the standard library and its client.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from serve_process import free_port, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
CLIENT_TIMEOUT_S = 900
QUESTIONS = (  # (question, choices, index of the answer)
    ("What is the capital of France?", ("Paris", "Rome", "Berlin", "Madrid"), 0),
    ("How many legs does a spider have?", ("six", "eight", "ten", "four"), 1),
    ("Which planet is known as the Red Planet?", ("Venus", "Jupiter", "Mars", "Saturn"), 2),
    ("What is 2 + 2?", ("3", "5", "22", "4"), 3),
    ("What colour is the sky on a clear day?", ("blue", "green", "red", "black"), 0),
    ("Which animal says 'meow'?", ("dog", "cat", "cow", "duck"), 1),
    ("How many days are in a week?", ("five", "ten", "seven", "twelve"), 2),
    ("What do bees make?", ("milk", "silk", "wool", "honey"), 3),
    ("Which is the largest ocean on Earth?", ("Pacific", "Atlantic", "Indian", "Arctic"), 0),
    ("What is frozen water called?", ("steam", "ice", "sand", "glass"), 1),
    ("Which keyword defines a function in Python?", ("func", "function", "def", "lambda"), 2),
    ("How many hours are in a day?", ("12", "60", "100", "24"), 3),
    ("What is the opposite of hot?", ("cold", "tall", "fast", "loud"), 0),
    ("Which gas do plants take in from the air?", ("oxygen", "carbon dioxide", "helium", "neon"), 1),
    ("What is the capital of Japan?", ("Beijing", "Seoul", "Tokyo", "Bangkok"), 2),
    ("Which shape has three sides?", ("square", "circle", "pentagon", "triangle"), 3),
    ("What is 10 times 10?", ("100", "20", "1000", "110"), 0),
    ("Which metal is liquid at room temperature?", ("iron", "mercury", "gold", "copper"), 1),
    ("In which continent is Egypt?", ("Europe", "Asia", "Africa", "South America"), 2),
    ("What is the boiling point of water at sea level in Celsius?", ("50", "0", "200", "100"), 3),
)
WEATHER = "It is 18 degrees and sunny in {city}."
# "Use the tool": asked without it, Qwen2.5-Coder-0.5B-Instruct often writes the call inside a ```json fence, which
# no tool parser (vLLM's neither) reads as a call
QUESTION = "What is the weather in Paris? Use the tool."


@dataclass(frozen=True)
class ClientResult:
    client: str  # with its version
    ran: str
    passed: bool
    figure: str  # the key number or outcome
    requests: str = ""  # the server's count of the client's requests by status


# ---- the clients (run in the clients' environment: standard library and the client only) ----

def run_lm_eval(url: str, model: str, workdir: Path) -> dict:
    data = workdir / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": list(c), "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    (workdir / "nebula_mc.yaml").write_text(
        "task: nebula_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    out = workdir / "lm_eval_out"
    model_args = (f"model={model},base_url={url}/v1/completions,tokenizer={workdir / 'tokenizer'},"
                  "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
               "--tasks", "nebula_mc", "--include_path", str(workdir), "--output_path", str(out)]
    _run_logged(command, workdir)
    [results] = out.rglob("results_*.json")
    accuracy = json.loads(results.read_text())["results"]["nebula_mc"]["acc,none"]
    return {"ran": f"local-completions, {len(QUESTIONS)}-question multiple choice (loglikelihood: echo + logprobs)",
            "passed": True, "figure": f"accuracy {accuracy:.2f}", "package": "lm-eval"}


def run_guidellm(url: str, model: str, workdir: Path) -> dict:
    out = workdir / "guidellm.json"
    command = [str(Path(sys.executable).parent / "guidellm"), "run",
               "--backend", f"kind=openai_http,target={url},model={model}", "--profile", "kind=synchronous",
               "--constraint", "kind=max_requests,count=8",
               "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
               "--tokenizer", f"kind=huggingface_auto,model={workdir / 'tokenizer'}",
               "--output", f"kind=json,path={out}", "--disable-console"]
    _run_logged(command, workdir)
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]
    ttft = metrics["time_to_first_token_ms"]["successful"]["median"]
    itl = metrics["inter_token_latency_ms"]["successful"]["median"]
    output_tokens = metrics["output_token_count"]["successful"]["total_sum"]
    return {"ran": "synchronous streaming chat benchmark, 8 synthetic requests (64 prompt / 16 output tokens)",
            "passed": totals["successful"] == totals["total"] == 8 and output_tokens == 8 * 16,
            "figure": f"{totals['successful']}/{totals['total']} ok, {output_tokens:.0f} output tokens counted, "
                      f"TTFT p50 {ttft:.0f} ms, ITL p50 {itl:.0f} ms", "package": "guidellm"}


def _run_logged(command: list[str], workdir: Path) -> None:
    """Run a client's own command line, its output in ``workdir/client.log``; a failure names its last lines."""
    log = workdir / "client.log"
    with open(log, "w") as out:
        code = subprocess.run(command, cwd=workdir, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = " / ".join(log.read_text().strip().splitlines()[-3:])
        raise RuntimeError(f"{Path(command[0]).name} exited with {code}: {tail}")


def run_langchain(url: str, model: str, workdir: Path) -> dict:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return WEATHER.format(city=city)

    llm = ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model=model, temperature=0, max_tokens=128)
    bound = llm.bind_tools([get_weather])
    messages = [HumanMessage(QUESTION)]
    reply = bound.invoke(messages)
    called = [(c["name"], c["args"]) for c in reply.tool_calls]
    messages += [reply] + [ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"]) for c in reply.tool_calls]
    follow_up = bound.invoke(messages)  # the tool result's round trip
    streamed = None
    for chunk in bound.stream(messages[:1]):
        streamed = chunk if streamed is None else streamed + chunk
    streamed_calls = [(c["name"], c["args"]) for c in streamed.tool_calls]
    after = (f"{len(follow_up.tool_calls)} more call(s)" if follow_up.tool_calls
             else f"answer {follow_up.content[:60]!r}")
    return {"ran": "bind_tools: invoke, tool result round trip, stream",
            "passed": called == [("get_weather", {"city": "Paris"})] and streamed_calls == called,
            "figure": f"tool_calls {called}, the same streamed; after the tool result: {after}",
            "package": "langchain-openai"}


def run_agents(url: str, model: str, workdir: Path) -> dict:
    import asyncio

    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return WEATHER.format(city=city)

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def agent(model_object) -> Agent:
        # the tool's result is the answer: small models call the tool again rather than answer from its result
        return Agent(name="weather", instructions="Answer weather questions with the get_weather tool.",
                     tools=[get_weather], model=model_object, tool_use_behavior="stop_on_first_tool",
                     model_settings=ModelSettings(temperature=0, max_tokens=100))

    async def runs() -> dict[str, str]:
        responses = agent(OpenAIResponsesModel(model=model, openai_client=client))
        streamed = Runner.run_streamed(responses, QUESTION, max_turns=3)
        async for _ in streamed.stream_events():
            pass
        chat = agent(OpenAIChatCompletionsModel(model=model, openai_client=client))
        return {"responses": (await Runner.run(responses, QUESTION, max_turns=3)).final_output,
                "responses, streamed": streamed.final_output,
                "chat completions": (await Runner.run(chat, QUESTION, max_turns=3)).final_output}

    outputs = asyncio.run(runs())
    expected = WEATHER.format(city="Paris")
    done = [kind for kind, output in outputs.items() if output == expected]
    return {"ran": "Agent + function tool, run to completion: /v1/responses (plain, streamed), chat completions model",
            "passed": len(done) == len(outputs) and calls == ["Paris"] * len(outputs),
            "figure": f"final output = tool result on {len(done)}/{len(outputs)} runs ({'; '.join(done)})",
            "package": "openai-agents"}


CLIENTS = {"lm-evaluation-harness": run_lm_eval, "guidellm": run_guidellm, "LangChain": run_langchain,
           "OpenAI Agents SDK": run_agents}


def client_main(name: str, url: str, model: str, workdir: Path) -> None:
    """In the clients' environment: run one client, print its result as the last line of stdout (JSON)."""
    from importlib.metadata import version

    result = CLIENTS[name](url, model, workdir)
    result["version"] = version(result.pop("package"))
    print(json.dumps(result))


# ---- the driver (this checkout's environment) ----

def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


def request_counts(url: str) -> dict[str, float]:
    """The server's finished requests by status (all endpoints): ``nebula_requests_total``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "nebula_requests_total":
                counts[sample.labels["status"]] = counts.get(sample.labels["status"], 0) + sample.value
    return counts


def offline_accuracy(model: str) -> float:
    """The multiple-choice task scored with the offline API, as lm-eval scores it: each choice's continuation
    (`` choice``, the tokens the whole text has beyond the question's) by the sum of its prompt logprobs."""
    from nebula_engine import LLM
    from nebula_engine.engine.sampling_params import SamplingParams

    llm = LLM(model)
    tokenizer = llm.get_tokenizer()
    right = 0
    for question, choices, answer in QUESTIONS:
        context = f"Question: {question}\nAnswer:"
        context_ids = tokenizer.encode(context, add_special_tokens=False)
        prompts, spans = [], []
        for choice in choices:
            ids = tokenizer.encode(f"{context} {choice}", add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids})
            spans.append(range(len(context_ids), len(ids)))
        scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        outputs = llm.generate(prompts, scoring, use_tqdm=False)
        scores = [sum(out.prompt_logprobs[i][out.prompt_token_ids[i]].logprob for i in span)
                  for out, span in zip(outputs, spans)]
        right += max(range(len(choices)), key=scores.__getitem__) == answer
    return right / len(QUESTIONS)


def save_tokenizer(model: str, out: Path) -> None:
    """The served model's tokenizer as a Hugging Face folder, which lm-eval and guidellm load offline."""
    from nebula_engine.catalog import resolve_model
    from nebula_engine.engine.tokenizer import Tokenizer

    Tokenizer(resolve_model(model)).hf.save_pretrained(str(out))


def run_client(name: str, clients_python: str, url: str, model: str, workdir: Path) -> ClientResult:
    before = request_counts(url)
    client_dir = workdir / name.replace(" ", "_")
    client_dir.mkdir()
    (client_dir / "tokenizer").symlink_to(workdir / "tokenizer")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [clients_python, str(Path(__file__).resolve()), "client", name, "--url", url, "--model", model,
               "--workdir", str(client_dir)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return ClientResult(name, "", False, f"did not finish within {CLIENT_TIMEOUT_S} s",
                            _status_delta(before, request_counts(url)))
    requests = _status_delta(before, request_counts(url))
    if done.returncode != 0:
        (client_dir / "stderr.txt").write_text(done.stderr)
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        return ClientResult(name, "", False, f"failed: {last}", requests)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    all_ok = set(_counts_by_status(before, request_counts(url))) <= {"ok"}
    return ClientResult(f"{name} {result['version']}", result["ran"], result["passed"] and all_ok, result["figure"],
                        requests)


def _counts_by_status(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {status: int(after[status] - before.get(status, 0)) for status in after
            if after[status] > before.get(status, 0)}


def _status_delta(before: dict[str, float], after: dict[str, float]) -> str:
    counts = _counts_by_status(before, after)
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "none"


@dataclass(frozen=True)
class Target:
    """A server the clients run against: its name in the tables and the ``serve`` arguments beyond the model."""

    name: str
    serve_args: tuple[str, ...] = ()


SINGLE = Target("serve")
LOCAL_CLUSTER = Target("local cluster, 2 prefill + 1 decode peers",
                       ("--prefill-workers", "2", "--decode-workers", "1"))


def table(results: list[ClientResult], target: Target = SINGLE):
    from nebula_engine.bench.results_page import Table

    return Table(("client", "what was run", "result", "key figure", "server's count of its requests"),
                 tuple((r.client, r.ran, "pass" if r.passed else "FAIL", r.figure, r.requests) for r in results),
                 caption=f"Against {target.name}" + (f": `{' '.join(target.serve_args)}`" if target.serve_args else ""))


def write_docs(runs: list[tuple[Target, list[ClientResult]]], model: str) -> Path:
    from nebula_engine.bench.results_page import ResultsPage, write_page

    page = ResultsPage(
        name="clients", title="Real clients against nebula-engine serve",
        about=(f"Each client teams point at vLLM, unmodified, against `nebula-engine serve --model {model}` on "
               "127.0.0.1 (one engine, and with `--cluster` a local cluster too), each in its own process. A client "
               "passes when it completes and reads what it needs from the answers, and every request it sent was "
               "answered 200 (the server's own `nebula_requests_total` by status, read before and after each "
               "client)."),
        tables=tuple(table(results, target) for target, results in runs),
        notes=("`ok` in the last column is a request answered 200 (`invalid`: a 4xx, `error`: a 5xx, `aborted`: "
               "the client went away).",
               "The multiple-choice task and the tokenizer are written by the tool: no hub access (the clients run "
               "with HF_HUB_OFFLINE=1).",
               "LangChain's follow-up after the tool result and the Agents SDK's `stop_on_first_tool`: "
               "Qwen2.5-Coder-0.5B-Instruct calls the tool again after its result rather than answer from it "
               "(Hugging Face transformers' greedy output on the same prompt does the same), so the agent run ends "
               "on the tool's result."))
    return write_page(page, ROOT / "docs" / "results")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    client = sub.add_parser("client", help="run one client (inside the clients' environment)")
    client.add_argument("name", choices=sorted(CLIENTS))
    client.add_argument("--url", required=True)
    client.add_argument("--model", required=True)
    client.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--clients-python", default=str(ROOT.parent / "clients-venv" / "bin" / "python"),
                        help="the Python that has the clients installed (default: ../clients-venv/bin/python)")
    parser.add_argument("--model", default=None, help="served model (default: serve's default)")
    parser.add_argument("--only", action="append", choices=sorted(CLIENTS), help="run only these clients")
    parser.add_argument("--cluster", action="store_true",
                        help="also run every client against a local cluster (serve --prefill-workers 2 "
                             "--decode-workers 1)")
    parser.add_argument("--write-docs", action="store_true", help="write docs/results/clients.md")
    args = parser.parse_args()
    if args.command == "client":
        client_main(args.name, args.url, args.model, args.workdir)
        return
    check(args)


def check(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from nebula_engine.catalog import DEFAULT_MODEL

    if not Path(args.clients_python).exists():
        sys.exit(f"no Python at {args.clients_python}: install the clients first (see this tool's docstring) or "
                 "pass --clients-python")
    model_arg = args.model or DEFAULT_MODEL
    targets = [SINGLE, LOCAL_CLUSTER] if args.cluster else [SINGLE]
    with tempfile.TemporaryDirectory(prefix="nebula-client-check-") as tmp:
        workdir = Path(tmp)
        save_tokenizer(model_arg, workdir / "tokenizer")
        offline = offline_accuracy(model_arg) if "lm-evaluation-harness" in (args.only or CLIENTS) else None
        runs = [(target, run_clients(target, args, model_arg, workdir / f"target{i}", workdir / "tokenizer"))
                for i, target in enumerate(targets)]
        if offline is not None:
            runs = [(target, [equal_to_offline(r, offline) for r in results]) for target, results in runs]
        for target, results in runs:
            print(table(results, target).markdown())
        if args.write_docs:
            print(f"wrote {write_docs(runs, model_arg)}")
        if not all(r.passed for _, results in runs for r in results):
            for path in workdir.rglob("stderr.txt"):
                print(f"--- {path.parent.name} stderr (tail) ---\n" + "\n".join(path.read_text().splitlines()[-20:]))
            sys.exit(1)


def equal_to_offline(result: ClientResult, offline: float) -> ClientResult:
    """lm-eval passes only when its accuracy equals the offline API's on the same task."""
    if not result.client.startswith("lm-eval") or not result.figure.startswith("accuracy "):
        return result
    served = float(result.figure.split()[1])
    same = f"{served:.2f}" == f"{offline:.2f}"  # 20 questions: multiples of 0.05
    return dataclasses.replace(result, passed=result.passed and same,
                               figure=f"{result.figure} (offline API: {offline:.2f})")


def run_clients(target: Target, args: argparse.Namespace, model_arg: str, workdir: Path,
                tokenizer: Path) -> list[ClientResult]:
    """Every client in turn against one server started for ``target``, stopped at the end."""
    workdir.mkdir()
    (workdir / "tokenizer").symlink_to(tokenizer)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(["--model", model_arg, *target.serve_args], port, workdir / "server.log", cwd=ROOT)
    try:
        model = served_model(url)
        results = []
        for name in args.only or CLIENTS:
            results.append(run_client(name, args.clients_python, url, model, workdir))
            print(f"{target.name}: {name}: {'pass' if results[-1].passed else 'FAIL'} - {results[-1].figure}",
                  flush=True)
        return results
    finally:
        stop_server(server)


if __name__ == "__main__":
    main()
