"""The official OpenAI Python client (`openai`) against a running `cohort serve`.

Driven by crates/cohort/tests/serve.rs, which starts the server, computes the expected
completions with `cohort sample` (same prompt, seed and settings) and passes them in a JSON spec:

    python3 openai_check.py SPEC.json

Checks /v1/models, completions (plain and streamed, alone and several concurrent streams with
different settings, which the server batches in flight) against `cohort sample`, and that what
cohort refuses comes back as OpenAI's error JSON with a 4xx. Prints one line per check and
"openai checks: N passed, M failed"; exits 1 if any failed.
"""

import json
import sys
import threading
import traceback
import urllib.error
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
    """The completion arguments of a case: top_k goes as vLLM's extra field."""
    kw = dict(model=MODEL, prompt=case["prompt"], max_tokens=case["max_tokens"],
              temperature=case["temperature"], seed=case["seed"])
    if case.get("top_k"):
        kw["extra_body"] = {"top_k": case["top_k"]}
    return kw


@check
def models_lists_the_model():
    ids = [m.id for m in client.models.list().data]
    assert MODEL in ids, ids


@check
def completions_match_cohort_sample():
    for case in spec["cases"]:
        r = client.completions.create(**args(case))
        assert r.object == "text_completion"
        assert r.choices[0].text == case["completion"], (r.choices[0].text, case)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == case["max_tokens"], r.usage
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@check
def streamed_completions_match_and_end_with_done():
    for case in spec["cases"]:
        chunks = list(client.completions.create(stream=True, **args(case)))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == case["completion"], (text, case)
        assert chunks[-1].choices[0].finish_reason == "length"
    # the raw stream ends with OpenAI's sentinel
    body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 3, "stream": True}).encode()
    req = urllib.request.Request(f"http://{HTTP}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    raw = urllib.request.urlopen(req).read().decode()
    events = [l for l in raw.splitlines() if l.startswith("data: ")]
    assert events[-1] == "data: [DONE]", raw


@check
def concurrent_streams_each_get_their_own_completion():
    results = {}

    def run(i, case):
        chunks = client.completions.create(stream=True, **args(case))
        results[i] = "".join(c.choices[0].text for c in chunks if c.choices)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(spec["cases"] * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, case in enumerate(spec["cases"] * 2):
        assert results[i] == case["completion"], (i, results[i], case)


def refused(status_cls, needle, **kw):
    try:
        client.completions.create(**{"model": MODEL, "prompt": "a", **kw})
    except status_cls as e:
        assert needle in str(e), (needle, str(e))
        body = e.body if isinstance(e.body, dict) else {}
        # the client hands over the "error" object
        assert body.get("type") == "invalid_request_error", e.body
        return
    raise AssertionError(f"{kw} was not refused")


@check
def unsupported_and_bad_fields_are_openai_errors():
    refused(openai.BadRequestError, "top_p", top_p=1.5)
    refused(openai.BadRequestError, "only 1 completion", n=2)
    refused(openai.BadRequestError, "stop", stop=["a", "b", "c", "d", "e"])
    refused(openai.BadRequestError, "suffix", suffix="x")
    refused(openai.BadRequestError, "max_tokens", max_tokens=0)
    refused(openai.BadRequestError, "temperature", temperature=-1)
    try:
        client.completions.create(model="no-such-model", prompt="a")
        raise AssertionError("an unknown model was served")
    except openai.NotFoundError as e:
        assert "no-such-model" in str(e), str(e)
    # the raw shape, for clients that are not this one
    req = urllib.request.Request(f"http://{HTTP}/v1/completions", b"{not json",
                                 {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req)
        raise AssertionError("bad JSON was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400, e.code
        err = json.loads(e.read())["error"]
        assert set(err) == {"message", "type", "param", "code"}, err


print(f"openai checks: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
