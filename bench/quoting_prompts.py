"""The four workloads of ``bench/speculative_workloads.py`` as OpenAI chat messages, in variants.

Each workload builds variant ``i`` from a generator seeded with its name and ``i``, so every server
and every round sees byte-identical prompts, and the variants differ in their content (names,
numbers, lines) while keeping their shape:

- ``doc_qa``: a ~600-token report in the user message, then the question: repeat one paragraph and
  the last one word for word;
- ``code_edit``: a ~400-token Python function; "rewrite it with one change" (rename a variable, or
  add a parameter in place of a constant), the whole function in the answer;
- ``agent_summary``: an agent turn: the task, an assistant ``tool_calls`` message, the ``tool``
  message with a ~600-token log, and the user asking for a summary that quotes its error lines;
- ``open_chat``: a question with nothing in the prompt to quote.
"""

from __future__ import annotations

import json
import random
import zlib

WORKLOADS = ("doc_qa", "code_edit", "agent_summary", "open_chat")
QUOTING = WORKLOADS[:3]

TOWNS = ("Ashford", "Brindle", "Carrow", "Dunmore", "Elston", "Fairholm", "Glenrock", "Harwick", "Ivybridge",
         "Kestrel Bay", "Larkmoor", "Millbrook")
PEOPLE = ("Maria Okafor", "Tomas Lindqvist", "Priya Raman", "Daniel Hughes", "Aiko Tanaka", "Samuel Reyes",
          "Elena Petrova", "Joseph Mensah", "Clara Weber", "Ravi Shah", "Fatima Haddad", "Liam O'Connor")
SECTIONS = {
    "water": "The water board reported that the {town} reservoir stood at {n1} percent of capacity at the end of "
             "the quarter, down from {n2} percent a year earlier. {person} explained that two of the older pumps "
             "at the northern station were replaced in {month}, which cut the energy bill by {n3} percent. The "
             "board asks households to report leaks through the new online form, and it will publish the weekly "
             "level on the town website from next month.",
    "school": "Enrolment at the {town} primary school rose to {n4} pupils, the highest number since the school "
              "opened. {person} said that the new library wing, finished in {month}, is now open after classes on "
              "three days a week. The school still needs {n1} volunteers for the reading programme, and parents "
              "who can help for one hour a week are asked to contact the office before the end of term.",
    "bridge": "Repairs to the old stone bridge over the {river} began in {month} and are expected to take {n1} "
              "weeks. The council has set a budget of {n5} pounds for the work, of which {n3} percent comes from "
              "the regional heritage fund. {person} confirmed that the footpath will stay open during the repairs, "
              "but vehicles heavier than {n2} tonnes must use the ring road until the work is complete.",
    "market": "The Saturday market in {town} now has {n4} stalls, and the trading committee approved {n1} new "
              "licences for food sellers this quarter. {person} reported that average footfall reached {n5} "
              "visitors a day in {month}. From the first of next month, stall holders will pay their fees by "
              "card at the market office, and cash payments will no longer be accepted.",
    "transport": "The number {n1} bus route will run every {n2} minutes during the morning peak from {month}, "
                 "after a survey showed that {n3} percent of passengers waited longer than a quarter of an hour. "
                 "{person} said that the new timetable will be printed at every stop. Two electric buses join the "
                 "fleet in the spring, and the depot on {street} will gain {n1} charging points.",
    "parks": "Volunteers planted {n4} trees in {town} park over the winter, and the pond was cleared of weed for "
             "the first time in {n2} years. {person} thanked the {n3} families who joined the planting days. The "
             "park cafe will reopen in {month} with longer hours, and the council will add new benches along the "
             "path by the {river}.",
    "library": "The town library lent {n5} books in the quarter, an increase of {n3} percent. {person} announced "
               "that the library will open on Sunday afternoons from {month}. The computer room was fitted with "
               "{n1} new machines, and free lessons for older residents run every Tuesday at ten o'clock in the "
               "reading room on {street}.",
}
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October")
RIVERS = ("Avon", "Tamar", "Wensum", "Derwent", "Ouse", "Lune")
STREETS = ("Mill Lane", "Church Street", "Station Road", "Hill Crescent", "Bridge Street", "Orchard Way")


def _rng(workload: str, variant: int) -> random.Random:
    return random.Random(zlib.crc32(f"{workload}:{variant}".encode()))


def doc_qa(variant: int) -> list[dict]:
    """A town report (six sections) and a question that asks to quote it."""
    rng = _rng("doc_qa", variant)
    town = TOWNS[variant % len(TOWNS)]
    names = rng.sample(list(SECTIONS), 6)
    paragraphs = [SECTIONS[name].format(
        town=town, person=rng.choice(PEOPLE), month=rng.choice(MONTHS), river=rng.choice(RIVERS),
        street=rng.choice(STREETS), n1=rng.randint(3, 40), n2=rng.randint(5, 60), n3=rng.randint(4, 35),
        n4=rng.randint(120, 900), n5=rng.randint(2_000, 90_000)) for name in names]
    document = f"Quarterly report of the {town} town council\n\n" + "\n\n".join(paragraphs)
    asked = rng.choice(names[:3])
    question = f"Repeat the paragraph about the {asked} word for word, then the last paragraph word for word."
    return [{"role": "system", "content": "You answer questions about documents. Quote the document exactly when asked."},
            {"role": "user", "content": f"{document}\n\n{question}"}]


FIELDS = ("price", "quantity", "discount", "weight", "tax_rate", "shipping")
VERBS = ("orders", "invoices", "shipments", "returns", "payments", "bookings")


def _function(rng: random.Random, noun: str) -> tuple[str, str, str]:
    """A ~40-line Python function over records; its name and two of its local variable names."""
    a, b, c = rng.sample(FIELDS, 3)
    limit, rate = rng.randint(10, 500), rng.choice((0.05, 0.1, 0.15, 0.2, 0.25))
    name = f"summarise_{noun}"
    code = f'''def {name}(records, currency="EUR"):
    """Group {noun} by customer and return totals, counts and flagged entries."""
    totals = {{}}
    counts = {{}}
    flagged = []
    skipped = 0
    for record in records:
        customer = record.get("customer")
        if not customer:
            skipped += 1
            continue
        amount = record.get("{a}", 0) * record.get("{b}", 1)
        if record.get("{c}"):
            amount -= amount * {rate}
        if record.get("currency", currency) != currency:
            amount = convert(amount, record["currency"], currency)
        totals[customer] = totals.get(customer, 0) + amount
        counts[customer] = counts.get(customer, 0) + 1
        if amount > {limit}:
            flagged.append((customer, record.get("id"), round(amount, 2)))
    average = {{}}
    for customer, total in totals.items():
        average[customer] = total / counts[customer]
    largest = sorted(totals.items(), key=lambda item: item[1], reverse=True)[:5]
    report = {{
        "currency": currency,
        "customers": len(totals),
        "skipped": skipped,
        "largest": largest,
        "average": average,
        "flagged": flagged,
    }}
    if flagged:
        log.warning("%d {noun} above {limit} %s", len(flagged), currency)
    return report
'''
    return code, name, str(limit)


def code_edit(variant: int) -> list[dict]:
    """A function and a request to rewrite it with one change."""
    rng = _rng("code_edit", variant)
    code, name, limit = _function(rng, VERBS[variant % len(VERBS)])
    if variant % 2 == 0:
        old, new = rng.choice((("totals", "sums"), ("flagged", "suspicious"), ("counts", "tallies")))
        change = f"rename the variable `{old}` to `{new}` everywhere in the function"
    else:
        change = f"add a parameter `threshold={limit}` after `records` and use it instead of the constant {limit}"
    return [{"role": "system", "content": "You are a careful programming assistant."},
            {"role": "user", "content": f"Here is a Python function:\n\n```python\n{code}```\n\nRewrite `{name}` "
                                        f"with one change: {change}. Output the whole rewritten function and "
                                        f"nothing else."}]


LEVELS = ("INFO", "INFO", "INFO", "WARNING", "ERROR")
EVENTS = {"INFO": ("worker {w} picked up job {j}", "job {j} finished in {t} ms", "cache hit ratio {p} percent",
                   "connected to database replica {w}", "health check passed on node {w}"),
          "WARNING": ("job {j} retried after timeout of {t} ms", "disk usage on node {w} at {p} percent",
                      "slow query on replica {w}: {t} ms"),
          "ERROR": ("job {j} failed: connection reset by peer", "worker {w} crashed with exit code {p}",
                    "payment service returned HTTP 503 for job {j}")}


def agent_summary(variant: int) -> list[dict]:
    """An agent turn: a tool call that read a log, its ~600-token result, and a request to summarise it."""
    rng = _rng("agent_summary", variant)
    service = rng.choice(("billing", "search", "checkout", "ingest", "mailer", "reports"))
    lines = []
    for i in range(16):
        level = rng.choice(LEVELS)
        event = rng.choice(EVENTS[level]).format(w=rng.randint(1, 9), j=rng.randint(1000, 9999),
                                                 t=rng.randint(50, 9000), p=rng.randint(1, 99))
        lines.append(f"2026-03-{variant % 28 + 1:02d} 14:{i * 3 + rng.randint(0, 2):02d}:{rng.randint(0, 59):02d} "
                     f"{level:7s} {service}: {event}")
    call = {"id": f"call_{variant:04d}", "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": f"logs/{service}.log"})}}
    return [{"role": "system", "content": "You are an operations agent. Use the tools to inspect the system."},
            {"role": "user", "content": f"Find out why the {service} service had problems this afternoon."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "\n".join(lines)},
            {"role": "user", "content": "Summarise the tool result above: first quote every ERROR and WARNING "
                                        "line exactly as it appears, one per line, then say in one sentence "
                                        "what went wrong."}]


QUESTIONS = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
             "Why do leaves change colour in autumn? Explain it to a ten-year-old.",
             "Describe a perfect weekend in the mountains.",
             "What are the pros and cons of working from home?",
             "Invent a new board game and explain how to play it.",
             "Write a letter from a cat to its owner about the new puppy.",
             "How would you plan a small vegetable garden for a beginner?",
             "Tell me about the history of bicycles in a few paragraphs.",
             "Write a poem about the sea at night.",
             "What makes a good teacher? Give your own view.",
             "Imagine a city in the year 2200 and describe a day there.",
             "Explain how to make friends after moving to a new town.")


# How the answer should read: the first round of variants asks the questions as they are, each
# later round with one of these, so that every variant up to 12 x 8 is a question of its own.
STYLES = ("", " Keep it under a hundred words.", " Write it for a children's magazine.",
          " Answer in the voice of a ship's captain.", " Use a numbered list.", " Start with a surprising fact.",
          " Make it sound like a radio broadcast.", " End with a question for the reader.")


def open_chat(variant: int) -> list[dict]:
    """A question whose answer quotes nothing in the prompt."""
    question = QUESTIONS[variant % len(QUESTIONS)]
    return [{"role": "user", "content": question + STYLES[variant // len(QUESTIONS) % len(STYLES)]}]


BUILDERS = {"doc_qa": doc_qa, "code_edit": code_edit, "agent_summary": agent_summary, "open_chat": open_chat}


def messages(workload: str, variant: int) -> list[dict]:
    """Variant ``variant`` of ``workload``'s chat messages (deterministic)."""
    return BUILDERS[workload](variant)
