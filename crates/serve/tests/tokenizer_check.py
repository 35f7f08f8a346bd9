"""BYTES tensors and the ensemble tokenizer -> GPT -> detokenizer served by `cohort serve`,
checked with Triton's Python client.

Driven by crates/cohort/tests/serve.rs:

    python3 tokenizer_check.py SPEC.json

The spec names the server's HTTP and gRPC addresses and, for each prompt, what cohort's own
tokenizer and forward pass give: its ids, the GPT's next token after them and that token's
text. The repository holds `tokenizer` (cohort_tokenizer, TEXT BYTES -> input_ids INT64),
`gpt`, `detokenizer` (ids INT64 [batch] -> TEXT BYTES), `detokenizer_seq` (ids INT64
[batch, seq] -> TEXT) and `textgen`, the ensemble PROMPT -> tokenizer -> gpt -> detokenizer
-> NEXT_TEXT (with NEXT_ID, and ECHO: the prompt's ids decoded again).

The checks: BYTES in metadata and config; the steps called in turn give what cohort computes,
and the ensemble gives exactly what the steps give, over HTTP (binary and JSON) and gRPC, for
one row and for two; the tokenizer round-trips the text exactly; bad BYTES input (a length
prefix running past the data over the binary extension, text that is not UTF-8 over gRPC) is
refused naming the tensor, and the server goes on serving; each step's model counts the
ensemble's requests. Prints one line per check and "tokenizer checks: N passed, M failed";
exits 1 if any failed.
"""

import http.client
import json
import struct
import sys
import traceback

import numpy as np


def serialize(texts):
    """Triton's serialized BYTES: each element a 4-byte little-endian length, then its bytes."""
    return b"".join(struct.pack("<I", len(t)) + t for t in texts)


def text(x):
    return x.decode("utf-8") if isinstance(x, bytes) else x


def check(spec_path):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    with open(spec_path) as f:
        spec = json.load(f)
    http_c = httpclient.InferenceServerClient(url=spec["http"])
    grpc_c = grpcclient.InferenceServerClient(url=spec["grpc"])
    cases = spec["cases"]
    passed, failed = 0, 0

    def run(fn):
        nonlocal passed, failed
        try:
            fn()
            passed += 1
            print(f"ok   {fn.__name__}")
        except Exception:
            failed += 1
            print(f"FAIL {fn.__name__}")
            traceback.print_exc(file=sys.stdout)

    def infer(client, model, name, array, datatype, outputs, binary=True):
        """The outputs of one request, over `client` ("http", "http-json" or "grpc")."""
        if client == "grpc":
            inp = grpcclient.InferInput(name, list(array.shape), datatype)
            inp.set_data_from_numpy(array)
            outs = [grpcclient.InferRequestedOutput(o) for o in outputs]
            r = grpc_c.infer(model, [inp], outputs=outs)
        else:
            binary = client == "http"
            inp = httpclient.InferInput(name, list(array.shape), datatype)
            inp.set_data_from_numpy(array, binary_data=binary)
            outs = [httpclient.InferRequestedOutput(o, binary_data=binary) for o in outputs]
            r = http_c.infer(model, [inp], outputs=outs)
        return [r.as_numpy(o) for o in outputs]

    def texts(prompts):
        return np.array([[p.encode("utf-8")] for p in prompts], dtype=np.object_)

    def steps_in_turn(client, prompts):
        """tokenizer, gpt, detokenizer and detokenizer_seq called one after another."""
        (ids,) = infer(client, "tokenizer", "TEXT", texts(prompts), "BYTES", ["input_ids"])
        (nxt,) = infer(client, "gpt", "input_ids", ids, "INT64", ["next_token"])
        (word,) = infer(client, "detokenizer", "ids", nxt, "INT64", ["TEXT"])
        (echo,) = infer(client, "detokenizer_seq", "ids", ids, "INT64", ["TEXT"])
        return ids, nxt, word, echo

    def metadata_and_config_say_bytes():
        for m in (
            http_c.get_model_metadata("tokenizer"),
            grpc_c.get_model_metadata("tokenizer", as_json=True),
        ):
            assert m["platform"] == "cohort_tokenizer", m
            t = m["inputs"][0]
            assert (t["name"], t["datatype"], [int(d) for d in t["shape"]]) == (
                "TEXT",
                "BYTES",
                [-1, 1],
            ), m
            assert m["outputs"][0]["datatype"] == "INT64", m
        c = http_c.get_model_config("textgen")
        assert c["input"][0]["data_type"] == "TYPE_STRING", c
        c = grpc_c.get_model_config("detokenizer", as_json=True)["config"]
        assert c["output"][0]["data_type"] == "TYPE_STRING", c
        assert c["backend"] == "cohort_tokenizer", c

    def the_steps_give_what_cohort_computes_and_the_tokenizer_round_trips():
        for client in ("http", "http-json", "grpc"):
            for case in cases:
                ids, nxt, word, echo = steps_in_turn(client, [case["prompt"]])
                assert ids.tolist() == [case["ids"]], (client, case, ids)
                assert nxt.tolist() == [case["next_id"]], (client, case, nxt)
                assert [text(w) for w in word.ravel()] == [case["next_text"]], (client, word)
                assert [text(e) for e in echo.ravel()] == [case["prompt"]], (client, echo)

    def the_ensemble_equals_its_steps_in_turn():
        outputs = ["NEXT_TEXT", "NEXT_ID", "ECHO"]
        batches = [[c["prompt"]] for c in cases] + [spec["same_length"]]
        for client in ("http", "http-json", "grpc"):
            for prompts in batches:
                _, nxt, word, echo = steps_in_turn(client, prompts)
                got = infer(client, "textgen", "PROMPT", texts(prompts), "BYTES", outputs)
                assert got[0].shape == (len(prompts), 1), got[0].shape
                assert got[0].dtype == np.object_, got[0].dtype
                assert [text(x) for x in got[0].ravel()] == [text(x) for x in word.ravel()], (
                    client,
                    prompts,
                    got[0],
                    word,
                )
                assert got[1].tolist() == nxt.tolist(), (client, prompts, got[1], nxt)
                assert [text(x) for x in got[2].ravel()] == prompts, (client, got[2])
                assert [text(x) for x in echo.ravel()] == prompts, (client, echo)

    def bad_bytes_are_refused_by_tensor_and_the_server_goes_on():
        # tritonclient only sends well-formed BYTES: the binary request is written by hand
        good = serialize([cases[0]["prompt"].encode("utf-8")])
        cut = good[:-2]
        head = json.dumps(
            {
                "inputs": [
                    {
                        "name": "PROMPT",
                        "datatype": "BYTES",
                        "shape": [1, 1],
                        "parameters": {"binary_data_size": len(cut)},
                    }
                ]
            }
        ).encode()
        host, port = spec["http"].rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request(
            "POST",
            "/v2/models/textgen/infer",
            body=head + cut,
            headers={"Inference-Header-Content-Length": str(len(head))},
        )
        r = conn.getresponse()
        body = json.loads(r.read())
        assert r.status == 400, (r.status, body)
        assert 'tensor "PROMPT"' in body["error"] and "length prefix says" in body["error"], body
        # not UTF-8 where the tokenizer needs text: refused through the ensemble too
        bad = np.array([[b"ab\xffc"]], dtype=np.object_)
        cases_bad = (("tokenizer", "TEXT", "input_ids"), ("textgen", "PROMPT", "ECHO"))
        for model, name, output in cases_bad:
            try:
                infer("grpc", model, name, bad, "BYTES", [output])
            except InferenceServerException as e:
                assert 'tensor "TEXT": element 0 is not UTF-8' in str(e), e
                assert e.status() == "StatusCode.INVALID_ARGUMENT", e.status()
            else:
                raise AssertionError(f"{model} accepted text that is not UTF-8")
        prompt = texts([cases[0]["prompt"]])
        got = infer("http", "textgen", "PROMPT", prompt, "BYTES", ["NEXT_TEXT"])
        assert [text(x) for x in got[0].ravel()] == [cases[0]["next_text"]], got

    def each_step_counts_the_ensembles_requests():
        models = ("textgen", "tokenizer", "gpt", "detokenizer", "detokenizer_seq")

        def count(model):
            s = http_c.get_inference_statistics(model)["model_stats"][0]
            return int(s["inference_stats"]["success"]["count"])

        before = {m: count(m) for m in models}
        for case in cases:
            infer("grpc", "textgen", "PROMPT", texts([case["prompt"]]), "BYTES", ["NEXT_TEXT"])
        after = {m: count(m) for m in models}
        assert all(after[m] == before[m] + len(cases) for m in models), (before, after)

    for fn in (
        metadata_and_config_say_bytes,
        the_steps_give_what_cohort_computes_and_the_tokenizer_round_trips,
        the_ensemble_equals_its_steps_in_turn,
        bad_bytes_are_refused_by_tensor_and_the_server_goes_on,
        each_step_counts_the_ensembles_requests,
    ):
        run(fn)
    print(f"tokenizer checks: {passed} passed, {failed} failed")
    return failed == 0


if __name__ == "__main__":
    if len(sys.argv) == 2:
        sys.exit(0 if check(sys.argv[1]) else 1)
    else:
        sys.exit(f"usage: {sys.argv[0]} SPEC.json")
