"""The official OpenAI Python client's chat API (`client.chat.completions`) against `cohort serve`.

Driven by crates/cohort/tests/serve.rs, which serves a tiny model whose directory has a chat
template, and computes each case's answer with `cohort sample` on the rendered conversation (cut
at the end-of-turn token and the stop strings). Spec:

    python3 openai_chat_check.py SPEC.json

Checks plain and streamed chats (streams end with `data: [DONE]`), two concurrent streamed chats
that must each get their solo answer, fields cohort refuses (OpenAI's error JSON naming the
field), completions of the rendered conversation (which stop at generation_config.json's eos ids
and the stop strings as the chat does), and Triton's generate and generate_stream with
`messages`. Prints one line per check and "openai chat checks: N passed, M failed"; exits 1 if any
failed.
"""

import json
import sys
import threading
import traceback
import urllib.request

import openai

spec = json.load(open(sys.argv[1]))
HTTP, MODEL = spec["http"], spec["model"]
client = openai.OpenAI(base_url=f"http://{HTTP}/v1", api_key="unused", max_retries=0)
passed, failed = 0, 0


def check(fn):
    global passed, failed
    try:
        fn()
        passed += 1
        print(f"ok   {fn.__name__}")
    except Exception:
        failed += 1
        print(f"FAIL {fn.__name__}")
        traceback.print_exc(file=sys.stdout)
    return fn


def args(case):
    kw = dict(model=MODEL, messages=case["messages"], max_tokens=case["max_tokens"],
              temperature=case["temperature"], seed=case["seed"])
    if case.get("stop"):
        kw["stop"] = case["stop"]
    if case.get("top_k"):
        kw["extra_body"] = {"top_k": case["top_k"]}
    if case.get("top_p") is not None:
        kw["top_p"] = case["top_p"]
    return kw


def streamed(case):
    """The content and finish reason of a streamed chat."""
    content, finish, roles = "", None, []
    for chunk in client.chat.completions.create(stream=True, **args(case)):
        delta = chunk.choices[0].delta
        if delta.role:
            roles.append(delta.role)
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"], roles
    return content, finish


@check
def plain_chats_answer_what_cohort_sample_generates():
    for case in spec["cases"]:
        r = client.chat.completions.create(**args(case))
        got = (r.choices[0].message.content, r.choices[0].finish_reason, r.choices[0].message.role)
        assert got == (case["content"], case["finish_reason"], "assistant"), (got, case)
        assert r.object == "chat.completion" and r.usage.prompt_tokens > 0


@check
def streamed_chats_add_up_to_the_same_answer_and_end_with_done():
    for case in spec["cases"]:
        assert streamed(case) == (case["content"], case["finish_reason"]), case
    body = json.dumps({**args(spec["cases"][0]), "stream": True}).encode()
    req = urllib.request.Request(f"http://{HTTP}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    text = urllib.request.urlopen(req).read().decode()
    events = [line for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]", events[-3:]


@check
def two_concurrent_chats_each_get_their_solo_answer():
    cases = spec["cases"][:2]
    results = [None, None]

    def run(i):
        results[i] = streamed(cases[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for case, got in zip(cases, results):
        assert got == (case["content"], case["finish_reason"]), (got, case)


@check
def refused_fields_come_back_as_openai_errors_naming_them():
    base = args(spec["cases"][0])
    for extra, param in [({"top_p": 1.5}, "top_p"), ({"n": 2}, "n"),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                         ({"extra_body": {"frobnicate": 1}}, "frobnicate")]:
        try:
            client.chat.completions.create(**{**base, **extra})
        except openai.BadRequestError as e:
            assert e.status_code == 400
            assert e.body["param"] == param, (e.body, param)
            assert e.body["type"] == "invalid_request_error"
        else:
            raise AssertionError(f"{param} was accepted")


@check
def completions_of_the_rendered_prompt_stop_as_the_chat_does():
    # The same sampling on the rendered conversation: the model's end of text
    # (generation_config.json's eos ids) and the stop strings end a completion as they end a chat.
    for case in spec["cases"]:
        kw = args(case)
        del kw["messages"]
        r = client.completions.create(prompt=case["prompt"], **kw)
        got = (r.choices[0].text, r.choices[0].finish_reason)
        assert got == (case["content"], case["finish_reason"]), (got, case)
        text, finish = "", None
        for chunk in client.completions.create(prompt=case["prompt"], stream=True, **kw):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        assert (text, finish) == (case["content"], case["finish_reason"]), (text, case)


def generate(case, stream):
    params = {"max_tokens": case["max_tokens"], "temperature": case["temperature"],
              "seed": case["seed"], "exclude_input_in_output": True}
    for k in ("top_k", "top_p"):
        if case.get(k) is not None:
            params[k] = case[k]
    body = json.dumps({"messages": case["messages"], "parameters": params}).encode()
    route = "generate_stream" if stream else "generate"
    req = urllib.request.Request(f"http://{HTTP}/v2/models/{MODEL}/{route}", body,
                                 {"Content-Type": "application/json"})
    text = urllib.request.urlopen(req).read().decode()
    if not stream:
        return json.loads(text)["text_output"]
    return "".join(json.loads(line[len("data: "):])["text_output"]
                   for line in text.splitlines() if line.startswith("data: "))


@check
def tritons_generate_takes_messages_and_stops_at_the_end_of_turn():
    # Stop strings are the OpenAI routes' own; the rest answers as the chat does.
    for case in spec["cases"]:
        if case.get("stop"):
            continue
        assert generate(case, False) == case["content"], case
        assert generate(case, True) == case["content"], case


print(f"openai chat checks: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
