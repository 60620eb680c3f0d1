"""An agent loop with tools on a real model, through ``nebula-engine serve`` and the ``openai`` client.

    python tools/agent_loop.py [--model qwen2.5-coder-0.5b] [--turns 4]

A support agent answers questions about orders. Each turn the user asks about an order; the model calls
``get_order`` (parsed from its Hermes ``<tool_call>`` output by the server: ``tool_choice: auto``), and the tool's
result, a long JSON record, goes back in a ``role: "tool"`` message wrapped in ``<pic>`` tags, so its KV is reused on
every later turn wherever it lands. The same scripted conversation runs against three servers, one after another,
each started fresh: PIC with the engine's default backend, PIC with ``full`` (exact: it must give PIC off's
answers), and PIC off. Per turn it prints prompt tokens, cached tokens (``usage.prompt_tokens_details``) and the time
to the first streamed token, then whether ``full`` answered exactly as PIC off. ``--write-docs`` writes the
results page ``docs/results/agent-loop.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pathlib import Path

from serve_process import free_port, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]

ORDERS = {
    f"W{1000 + i}": {
        "order_id": f"W{1000 + i}", "status": status, "customer": name, "address": address,
        "items": [{"product": product, "sku": f"SKU-{i}{j}", "price": price, "quantity": j + 1}
                  for j, (product, price) in enumerate(items)],
        "payment": {"method": "credit card", "last4": f"{4200 + i}"},
        "history": [f"2026-11-{10 + i:02d} order placed", f"2026-11-{11 + i:02d} payment confirmed",
                    f"2026-11-{12 + i:02d} {status}"],
    }
    for i, (status, name, address, items) in enumerate((
        ("shipped", "Ada Park", "12 Elm Street, Springfield", [("desk lamp", 39.5), ("USB cable", 9.99)]),
        ("processing", "Li Wei", "88 Harbour Road, Portsmouth", [("mechanical keyboard", 129.0)]),
        ("delivered", "Sam Osei", "4 Hill Lane, Leeds", [("water bottle", 18.0), ("backpack", 74.0),
                                                           ("notebook", 6.5)]),
        ("cancelled", "Maria Rossi", "19 Via Roma, Turin", [("headphones", 199.0)]),
    ))
}
QUESTIONS = ("What is the status of order W1000?", "Who placed order W1001, and where does it ship?",
             "How many items are in order W1002, and what do they cost in total?",
             "Was order W1003 paid by card? Answer briefly.", "Which of the orders we discussed was shipped first?")
TOOLS = [{"type": "function", "function": {
    "name": "get_order", "description": "Look up an order by its id (like W1000).",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}]
SYSTEM = "You are a support agent for an online shop. Use the get_order tool to look orders up. Be brief."


def timed_turn(client, model: str, messages: list[dict], max_tokens: int) -> tuple[dict, float, dict]:
    """One streamed chat call: (the assistant message as a dict, seconds to the first token, usage)."""
    started = time.perf_counter()
    first = None
    content, calls, usage = "", {}, {}
    stream = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0.0,
                                            max_tokens=max_tokens, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            if first is None and (choice.delta.content or choice.delta.tool_calls):
                first = time.perf_counter() - started
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": call.id, "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                entry["function"]["name"] += call.function.name or ""
                entry["function"]["arguments"] += call.function.arguments or ""
    message = {"role": "assistant", "content": content}
    if calls:  # content may be null only beside tool calls (the chat API's rule)
        message["content"] = content or None
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, first if first is not None else time.perf_counter() - started, usage


def run_conversation(client, model: str, turns: int, max_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    rows = []
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        for step in range(2):  # the call, then the answer from its result
            message, ttft, usage = timed_turn(client, model, messages, max_tokens)
            details = usage.get("prompt_tokens_details") or {}
            rows.append({"question": question, "step": step, "prompt_tokens": usage.get("prompt_tokens"),
                         "cached_tokens": details.get("cached_tokens"), "ttft_s": ttft,
                         "calls": [c["function"]["name"] + c["function"]["arguments"]
                                   for c in message.get("tool_calls", ())],
                         "content": message["content"]})
            messages.append(message)
            if "tool_calls" not in message:
                break
            for call in message["tool_calls"]:
                try:
                    order_id = json.loads(call["function"]["arguments"]).get("order_id", "")
                except json.JSONDecodeError:
                    order_id = ""
                record = ORDERS.get(str(order_id).strip(), {"error": f"no order {order_id!r}"})
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": f"<pic>{json.dumps(record, indent=1)}</pic>"})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--turns", type=int, default=4, choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--default-backend", default="auto", help="the PIC backend of the first run")
    parser.add_argument("--out", help="write every run's rows here (JSON)")
    parser.add_argument("--write-docs", action="store_true", help="write docs/results/agent-loop.md")
    args = parser.parse_args()

    import openai

    results = {}
    for variant in (args.default_backend, "full", "none"):
        port = free_port()
        server = start_server(["--model", args.model, "--pic-backend", variant], port,
                              f"/tmp/agent_loop_{variant}.log")
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            results[variant] = run_conversation(client, args.model, args.turns, args.max_tokens)
        finally:
            stop_server(server)
        print(f"\npic backend {variant}:")
        print(f"{'turn':>4} {'step':>4} {'prompt':>7} {'cached':>7} {'ttft s':>7}  reply")
        for i, row in enumerate(results[variant]):
            reply = reply_text(row)
            print(f"{i:>4} {row['step']:>4} {row['prompt_tokens']:>7} {row['cached_tokens']:>7} "
                  f"{row['ttft_s']:>7.2f}  {reply[:70]!r}", flush=True)
    replies = {variant: [(r["calls"], r["content"]) for r in rows] for variant, rows in results.items()}
    exact = replies["full"] == replies["none"]
    same_default = replies[args.default_backend] == replies["none"]
    print(f"\nfull (exact) replies equal PIC off's: {exact}; {args.default_backend} replies equal PIC off's: "
          f"{same_default}")
    if args.out:
        with open(args.out, "w") as out:
            json.dump(results, out, indent=1)
    if args.write_docs:
        print(f"wrote {write_docs(results, args.model, args.default_backend, exact, same_default)}")
    return 0 if exact else 1


def reply_text(row: dict) -> str:
    return "; ".join(row["calls"]) or (row["content"] or "")


def write_docs(results: dict[str, list[dict]], model: str, default_backend: str, exact: bool,
               same_default: bool) -> Path:
    sys.path.insert(0, str(ROOT))
    from nebula_engine.bench.results_page import ResultsPage, Table, write_page

    header = ("turn", "step", "prompt tokens", "cached tokens", "TTFT s", "reply")
    names = {default_backend: f"PIC backend `{default_backend}` (the default)", "full": "PIC backend `full` (exact)",
             "none": "PIC off"}
    tables = tuple(Table(header, tuple((i, row["step"], row["prompt_tokens"], row["cached_tokens"],
                                        f"{row['ttft_s']:.2f}", reply_text(row)[:80])
                                       for i, row in enumerate(rows)), caption=names[variant])
                   for variant, rows in results.items())
    page = ResultsPage(
        name="agent-loop", title="An agent loop with tool results reused by PIC",
        about=(f"A support agent on `{model}` served by `nebula-engine serve`, driven by the `openai` client: each "
               "user turn the model calls `get_order` (parsed from its Hermes tool call, `tool_choice: auto`), and "
               "the tool's JSON record goes back in a `role: \"tool\"` message inside `<pic>` tags, so its KV is "
               "reused on later turns wherever it lands. The same scripted conversation runs against three fresh "
               "servers: PIC with the default backend, PIC with `full` (exact) and PIC off; greedy decoding."),
        tables=tables,
        notes=(f"`full` replies equal PIC off's: {'yes' if exact else 'NO'}; `{default_backend}` replies equal PIC "
               f"off's: {'yes' if same_default else 'no'}.",
               "cached tokens: `usage.prompt_tokens_details.cached_tokens`, prompt tokens whose KV was used without "
               "recomputation (prefix cache and PIC); TTFT: to the first streamed token, on a shared CPU (noisy)."))
    return write_page(page, ROOT / "docs" / "results")


if __name__ == "__main__":
    sys.exit(main())
