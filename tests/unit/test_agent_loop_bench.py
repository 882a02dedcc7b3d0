"""The agent-loop benchmark's fairness: through the ``tools`` field, vLLM's template
(``bench/smollm2_tools.jinja``) renders the trace exactly as kvhive renders it for the default
model, whose own template has no tool support; streamed calls compare by what the model wrote;
the speculative arms run on servers of their own with the configs they name."""

from __future__ import annotations

import argparse
import copy
import json
import os

import agent_loop
import agent_trace
import pytest
from sessions_vs_vllm import call_text

from kvhive.core.chat_template import ChatTemplate
from kvhive.core.model_files import default_model_path
from kvhive.core.tokenizer import Tokenizer
from kvhive.core.tool_formats import parser_for_template
from kvhive.server.tools import ToolChoice, ToolPlan, chat_functions, check_history, prompt_messages


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


@pytest.mark.parametrize("turn", [1, 3])
def test_the_template_vllm_gets_renders_as_kvhive_does(tokenizer: Tokenizer, turn: int) -> None:
    messages = agent_trace.messages(agent=2, turn=turn, salt="s", tools_field=True)
    tools = agent_trace.tool_definitions()
    ours = copy.deepcopy(messages)
    check_history(ours, [f"messages[{i}]" for i in range(len(ours))])
    template = tokenizer.chat_template
    assert template is not None and not template.reads("tools")
    plan = ToolPlan(chat_functions(tools), ToolChoice("auto"), True, parser_for_template(template.source), None)
    rendered, variables = prompt_messages(template, ours, plan)
    kvhive_text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, **variables)

    with open(agent_loop.TEMPLATE) as f:
        bench_template = ChatTemplate(f.read(), {})
    vllm_text = bench_template.render(copy.deepcopy(messages), add_generation_prompt=True, tools=tools)
    assert vllm_text == kvhive_text
    assert vllm_text.count("<|im_start|>assistant\n<tool_call>\n{\"name\": ") == turn       # each call
    assert vllm_text.count("<|im_start|>tool\n") == turn                                     # each result
    assert "search_web" in vllm_text and vllm_text.endswith("<|im_start|>assistant\n")


def test_vllm_gets_the_hermes_parser_and_the_template_with_tools() -> None:
    args = type("Args", (), {"tools_field": True, "vllm_args": "--enforce-eager"})()
    extra = agent_loop.vllm_extra(args, agent_loop.TEMPLATE)
    assert extra.startswith(f"--chat-template {agent_loop.TEMPLATE} ") and extra.endswith(" --enforce-eager")
    assert "--enable-auto-tool-choice --tool-call-parser hermes" in extra
    assert os.path.exists(agent_loop.TEMPLATE)
    args.tools_field = False
    assert agent_loop.vllm_extra(args, agent_loop.TEMPLATE) == "--enforce-eager"


def test_speculative_arms_get_their_own_servers_with_the_config() -> None:
    args = argparse.Namespace(arms=["kvhive", "kvhive_conv_spec", "vllm_ngram"], tools_field=True, vllm_args="",
                              kvhive_args="--kv-cache-gb 4", dtype="float32", port=8999,
                              speculative_config=agent_loop.compact(agent_loop.KVHIVE_SPEC),
                              vllm_speculative_config=agent_loop.compact(agent_loop.VLLM_SPEC))
    jobs = {name: (cmd, env, passes) for cmd, env, passes, name in agent_loop.server_jobs(args)}
    assert sorted(jobs) == ["kvhive", "kvhive_spec", "vllm_ngram"]
    assert jobs["kvhive"][2] == [("kvhive", False)] and "--speculative-config" not in jobs["kvhive"][0]
    cmd, _, passes = jobs["kvhive_spec"]
    assert passes == [("kvhive_conv_spec", True)]
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == agent_loop.KVHIVE_SPEC
    extra = jobs["vllm_ngram"][1]["VLLM_EXTRA"].split()     # vllm.sh splits it on spaces
    assert json.loads(extra[extra.index("--speculative-config") + 1]) == agent_loop.VLLM_SPEC
    assert "--tool-call-parser" in extra
    assert agent_loop.plain_arm("kvhive_conv_spec") == "kvhive_conv" and agent_loop.plain_arm("vllm") is None


def test_streamed_calls_compare_by_name_and_arguments() -> None:
    # kvhive's and vLLM's first chunks differ in ids and key order; the text is what the model wrote.
    kvhive = [[{"index": 0, "id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": ""}}],
              [{"index": 0, "function": {"arguments": '{"path": '}}], [{"index": 0, "function": {"arguments": '"a"}'}}]]
    vllm = [[{"id": "chatcmpl-tool-9", "type": "function", "index": 0, "function": {"name": "read_file"}}],
            [{"index": 0, "function": {"arguments": '{"path": "a"}'}}]]
    assert "".join(map(call_text, kvhive)) == "".join(map(call_text, vllm)) == 'read_file{"path": "a"}'
    assert call_text([{"index": 0, "function": {"name": "a", "arguments": "{}"}},
                      {"index": 1, "function": {"name": "b", "arguments": "[]"}}]) == "a{}b[]"
