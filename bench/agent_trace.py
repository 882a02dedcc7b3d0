"""The agent-loop trace of ``bench/agent_loop.py``: tool definitions, calls, results and the messages.

Every agent shares one system prompt (instructions and 20 tool definitions as JSON schemas, about
3,000 tokens with SmolLM2's tokenizer) and has its own task. Turn ``t`` (1-based) sends the system
prompt, the task and ``t`` rounds of an assistant tool call (~60 tokens) and its result (~300
tokens), then asks for the next step. The calls and results are canned, built from a seeded random
generator, so every server sees byte-identical prompts.

Two wire forms of the same history:

- plain chat (the default): the definitions as text in the system message, each call as the
  assistant message's content in Hermes form (``<tool_call>{...}</tool_call>``), each result as a
  user message in Hermes form (``<tool_response>...</tool_response>``: a ``tool`` message must
  answer a call of an assistant's ``tool_calls``, which this form has none of);
- the ``tools`` field: the definitions in ``tools``, each call as the assistant message's
  ``tool_calls``, each result as a ``tool`` message with its ``tool_call_id``.
"""

from __future__ import annotations

import json
import random

NUM_TOOLS = 20


def _param(kind: str, description: str, **extra) -> dict:
    return {"type": kind, "description": description, **extra}


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


def tool_definitions() -> list[dict]:
    """Twenty function tools in OpenAI's shape, with realistic JSON-schema parameters."""
    path = _param("string", "Path relative to the repository root, using forward slashes.")
    limit = _param("integer", "Largest number of items to return.", minimum=1, maximum=100, default=10)
    return [
        _tool("search_web", "Search the public web and return the top results with title, URL and a short snippet.",
              {"query": _param("string", "The search query, in plain words."), "max_results": limit,
               "recency_days": _param("integer", "Only results published within this many days.", minimum=1)},
              ["query"]),
        _tool("fetch_url", "Download a web page and return its readable text, without scripts and navigation.",
              {"url": _param("string", "Absolute http or https URL.", format="uri"),
               "max_chars": _param("integer", "Truncate the text after this many characters.", default=8000)},
              ["url"]),
        _tool("read_file", "Read a text file from the working repository and return its lines with line numbers.",
              {"path": path, "start_line": _param("integer", "First line to return, 1-based.", minimum=1),
               "end_line": _param("integer", "Last line to return, inclusive.", minimum=1)}, ["path"]),
        _tool("write_file", "Create or overwrite a text file in the working repository with the given content.",
              {"path": path, "content": _param("string", "The full new content of the file."),
               "create_dirs": _param("boolean", "Create missing parent directories.", default=True)},
              ["path", "content"]),
        _tool("list_directory", "List the entries of a directory with their sizes and modification times.",
              {"path": path, "recursive": _param("boolean", "Descend into subdirectories.", default=False),
               "pattern": _param("string", "Glob pattern the entries must match, for example *.py.")}, ["path"]),
        _tool("search_code", "Search the repository for a regular expression and return matching lines with context.",
              {"pattern": _param("string", "A regular expression in Python syntax."),
               "path": path, "context_lines": _param("integer", "Lines of context around each match.", default=2),
               "max_results": limit}, ["pattern"]),
        _tool("run_shell", "Run a shell command in a sandbox and return its exit status, stdout and stderr.",
              {"command": _param("string", "The command line, run with bash -c."),
               "timeout_s": _param("number", "Seconds before the command is killed.", minimum=1, maximum=600),
               "workdir": path}, ["command"]),
        _tool("run_tests", "Run the project's test suite or a subset of it and return a summary of failures.",
              {"selector": _param("string", "A pytest node id, file or -k expression."),
               "fail_fast": _param("boolean", "Stop at the first failure.", default=True)}, []),
        _tool("git_commit", "Stage the given paths and create a commit with the message.",
              {"paths": _param("array", "Files to stage.", items={"type": "string"}),
               "message": _param("string", "The commit message: a summary line, a blank line, then details.")},
              ["paths", "message"]),
        _tool("query_database", "Run a read-only SQL query against the analytics warehouse and return rows as JSON.",
              {"sql": _param("string", "One SELECT statement in the warehouse's SQL dialect."),
               "max_rows": _param("integer", "Largest number of rows to return.", default=100, maximum=5000),
               "timeout_s": _param("number", "Seconds before the query is cancelled.", default=30)}, ["sql"]),
        _tool("send_email", "Send an email on the user's behalf; use only after the user confirmed the text.",
              {"to": _param("array", "Recipient addresses.", items={"type": "string", "format": "email"}),
               "subject": _param("string", "Subject line."), "body": _param("string", "Plain-text body."),
               "cc": _param("array", "Addresses in copy.", items={"type": "string", "format": "email"})},
              ["to", "subject", "body"]),
        _tool("create_calendar_event", "Create an event in the user's calendar and invite the attendees.",
              {"title": _param("string", "Event title."),
               "start": _param("string", "Start time in ISO 8601 with a time zone offset.", format="date-time"),
               "duration_minutes": _param("integer", "Length of the event.", minimum=5, maximum=1440),
               "attendees": _param("array", "Attendee email addresses.", items={"type": "string"})},
              ["title", "start"]),
        _tool("get_weather", "Get the current weather and a short forecast for a place.",
              {"location": _param("string", "City name, optionally with country, e.g. Lyon, France."),
               "units": _param("string", "Unit system.", enum=["metric", "imperial"], default="metric"),
               "days": _param("integer", "Days of forecast.", minimum=0, maximum=7, default=1)}, ["location"]),
        _tool("translate_text", "Translate text between languages and keep the formatting.",
              {"text": _param("string", "The text to translate."),
               "source_language": _param("string", "ISO 639-1 code, or auto to detect it.", default="auto"),
               "target_language": _param("string", "ISO 639-1 code of the target language.")},
              ["text", "target_language"]),
        _tool("summarize_document", "Summarize a long document that was fetched or read earlier in this session.",
              {"document_id": _param("string", "The id returned by fetch_url or read_file."),
               "style": _param("string", "Summary style.", enum=["bullets", "paragraph", "tldr"]),
               "max_words": _param("integer", "Upper bound on the summary's length.", default=200)},
              ["document_id"]),
        _tool("create_ticket", "Open a ticket in the issue tracker with a title, description and labels.",
              {"project": _param("string", "Project key, e.g. OPS."), "title": _param("string", "One-line summary."),
               "description": _param("string", "Markdown description with steps to reproduce."),
               "priority": _param("string", "Priority.", enum=["low", "medium", "high", "urgent"]),
               "labels": _param("array", "Labels to add.", items={"type": "string"})}, ["project", "title"]),
        _tool("update_ticket", "Change the status, assignee or fields of an existing ticket, or add a comment.",
              {"ticket_id": _param("string", "Ticket key, e.g. OPS-1234."),
               "status": _param("string", "New status.", enum=["open", "in_progress", "blocked", "done"]),
               "assignee": _param("string", "User name of the new assignee."),
               "comment": _param("string", "A comment to add, in Markdown.")}, ["ticket_id"]),
        _tool("get_metrics", "Read a time series from the monitoring system over a time range.",
              {"metric": _param("string", "Metric name with optional label matchers in PromQL."),
               "start": _param("string", "Range start, ISO 8601 or relative like -1h."),
               "end": _param("string", "Range end, ISO 8601 or now.", default="now"),
               "step_s": _param("integer", "Resolution in seconds.", minimum=1, default=60)}, ["metric", "start"]),
        _tool("convert_currency", "Convert an amount between currencies at the latest reference rate.",
              {"amount": _param("number", "The amount to convert."),
               "from_currency": _param("string", "ISO 4217 code, e.g. EUR."),
               "to_currency": _param("string", "ISO 4217 code, e.g. USD.")}, ["amount", "from_currency", "to_currency"]),
        _tool("schedule_reminder", "Remind the user of something at a given time through their preferred channel.",
              {"text": _param("string", "What to remind the user of."),
               "at": _param("string", "When, in ISO 8601 with a time zone offset.", format="date-time"),
               "channel": _param("string", "Delivery channel.", enum=["push", "email", "sms"], default="push")},
              ["text", "at"]),
    ]


INSTRUCTIONS = """You are Atlas, an autonomous engineering assistant working for the platform team. You solve the \
user's task step by step with the tools below. At each step, think about what you already know from earlier tool \
results, then either call exactly one tool or, when the task is done, answer the user with a short summary.

Rules:
- Call a tool by writing a JSON object with its name and arguments inside <tool_call></tool_call> tags, and \
nothing else in that message.
- Arguments must match the tool's parameters schema exactly; never invent parameters.
- Prefer reading before writing: inspect files, logs and metrics before you change anything.
- Never send an email or create a calendar event the user has not confirmed.
- Keep secrets out of tickets, commits and emails.
- When a tool fails, read the error, fix the arguments and try again at most twice.
- When you answer the user, say what you changed, what you checked and what is left to do.

Environment: the repository is at /srv/app, the warehouse is read-only, the shell has no network access, and the \
user's time zone is Europe/Paris."""


def _tool_lines() -> str:
    """The definitions as Hermes-style text: one JSON object per line inside <tools></tools>."""
    return "\n".join(json.dumps(t["function"]) for t in tool_definitions())


def system_prompt(salt: str, with_tools_text: bool = True) -> str:
    """The shared system prompt; ``salt`` first, so that each run's prefix is its own."""
    text = f"Run {salt}.\n{INSTRUCTIONS}"
    if with_tools_text:
        text += ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query. "
                 "The function signatures are within <tools></tools> XML tags:\n<tools>\n"
                 f"{_tool_lines()}\n</tools>\n\nFor each function call, return a json object with function "
                 "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                 '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    return text


_SERVICES = ["billing-api", "search-indexer", "auth-gateway", "report-builder", "event-ingest", "media-resizer",
             "notification-hub", "ledger-sync"]
_SYMPTOMS = ["p99 latency doubled since the last deploy", "the nightly export job fails with a timeout",
             "memory grows until the pod is killed", "error rate rose to 4% on the checkout path",
             "a queue backlog keeps growing during the day", "disk usage alerts fire every few hours",
             "duplicate rows appear in the daily report", "requests from one region are rejected"]
_WORDS = ["request", "worker", "cache", "latency", "retry", "timeout", "batch", "queue", "config", "shard",
          "replica", "memory", "thread", "pool", "index", "deploy", "metric", "error", "client", "session"]


def user_task(agent: int) -> str:
    """The agent's task: one service, one symptom."""
    service, symptom = _SERVICES[agent % len(_SERVICES)], _SYMPTOMS[(3 * agent + 1) % len(_SYMPTOMS)]
    return (f"Task {agent}: on the {service} service, {symptom}. Find the cause, fix it in the repository, "
            f"check the fix with the tests and the metrics, and open a ticket that explains what happened.")


def tool_call(agent: int, turn: int) -> tuple[str, dict]:
    """The assistant's canned call of ``turn`` (1-based): the function name and its arguments."""
    rng = random.Random(1000 * agent + turn)
    service = _SERVICES[agent % len(_SERVICES)]
    module = f"src/{service.replace('-', '_')}/{rng.choice(_WORDS)}_{rng.choice(_WORDS)}.py"
    calls = [
        ("search_code", {"pattern": f"def (handle|process)_{rng.choice(_WORDS)}\\(", "path": f"src/{service}",
                         "context_lines": 3, "max_results": 20}),
        ("read_file", {"path": module, "start_line": rng.randint(1, 200), "end_line": rng.randint(220, 400)}),
        ("get_metrics", {"metric": f'histogram_quantile(0.99, rate(http_request_seconds_bucket{{service="{service}"}}[5m]))',
                         "start": "-6h", "end": "now", "step_s": 300}),
        ("run_shell", {"command": f"grep -rn '{rng.choice(_WORDS)}_{rng.choice(_WORDS)}' /srv/app/src | head -40",
                       "timeout_s": 30, "workdir": "src"}),
        ("query_database", {"sql": f"SELECT day, count(*) AS n, avg(duration_ms) FROM {service.replace('-', '_')}_jobs "
                                   f"WHERE day > current_date - 7 GROUP BY day ORDER BY day", "max_rows": 50}),
        ("run_tests", {"selector": f"tests/{service.replace('-', '_')} -k {rng.choice(_WORDS)}", "fail_fast": True}),
    ]
    return calls[(agent + turn) % len(calls)]


def tool_call_text(agent: int, turn: int) -> str:
    """The call in Hermes form, as the assistant message's content (about 60 tokens)."""
    name, arguments = tool_call(agent, turn)
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def tool_result(agent: int, turn: int) -> str:
    """The call's canned result: a JSON object of about 300 tokens."""
    rng = random.Random(7919 * agent + turn)
    name, _ = tool_call(agent, turn)
    rows = []
    for _ in range(6):
        a, b, c = rng.choice(_WORDS), rng.choice(_WORDS), rng.choice(_WORDS)
        rows.append({"line": rng.randint(1, 900), "text": f"{a}_{b} = self.{c}.get({a!r}, {rng.randint(1, 500)})",
                     "ms": round(rng.uniform(0.5, 900.0), 1)})
    return json.dumps({"tool": name, "status": "ok", "elapsed_ms": rng.randint(5, 3000), "rows": rows,
                       "note": f"{len(rows)} of {rng.randint(10, 90)} matches shown; results are truncated."})


def call_id(agent: int, turn: int) -> str:
    return f"call_{agent}_{turn}"


def messages(agent: int, turn: int, salt: str, tools_field: bool = False) -> list[dict]:
    """The history turn ``turn`` (1-based) sends: system, task, then ``turn`` calls and results."""
    out = [{"role": "system", "content": system_prompt(salt, with_tools_text=not tools_field)},
           {"role": "user", "content": user_task(agent)}]
    for t in range(1, turn + 1):
        if tools_field:
            name, arguments = tool_call(agent, t)
            out.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id(agent, t), "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments)}}]})
            out.append({"role": "tool", "tool_call_id": call_id(agent, t), "content": tool_result(agent, t)})
        else:
            out.append({"role": "assistant", "content": tool_call_text(agent, t)})
            out.append({"role": "user", "content": f"<tool_response>\n{tool_result(agent, t)}\n</tool_response>"})
    return out
