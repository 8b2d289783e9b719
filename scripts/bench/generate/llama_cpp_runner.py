"""Time one llama.cpp model on one prompt, for `bench_llama_cpp.py`: run by the Python that has llama-cpp-python
(``--llama-python``), never imported by the package.

Reads a JSON job on stdin (``gguf``, ``threads``, ``prompt_ids``, ``new_tokens``, ``runs``) and prints one JSON
line: per run the first token's seconds (the prompt's evaluation and the first token), the decode seconds a step
(``(whole - first) / (new - 1)``), and the tokens. Greedy; the end-of-sequence token does not stop a run (both
sides generate exactly ``new_tokens``). The first run warms up and is not reported. The KV cache is cleared
before every run, so no run reuses another's prompt.

``quantize`` mode (``{"quantize": [src, dst, ftype]}``) writes `dst` from `src` with llama.cpp's quantizer
(requantizing allowed) and prints ``{}``.
"""

import argparse
import json
import sys
import time


def quantize(src: str, dst: str, ftype: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantize {src} to {dst} (ftype {ftype})")


def time_runs(job: dict) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=job["gguf"], n_threads=job["threads"], n_threads_batch=job["threads"], n_ctx=512,
                n_batch=512, verbose=False)
    results = []
    for _ in range(job["runs"] + 1):  # the first warms up
        llm.reset()
        tokens, first = [], None
        start = time.perf_counter()
        for token in llm.generate(job["prompt_ids"], temp=0.0, top_k=1, reset=True):
            if first is None:
                first = time.perf_counter() - start
            tokens.append(token)
            if len(tokens) == job["new_tokens"]:
                break
        whole = time.perf_counter() - start
        results.append({"first_s": first, "step_s": (whole - first) / (job["new_tokens"] - 1), "tokens": tokens})
    return {"runs": results[1:]}


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)  # the job comes on stdin
    request = json.load(sys.stdin)
    if "quantize" in request:
        quantize(*request["quantize"])
        print("{}")
    else:
        print(json.dumps(time_runs(request)))


if __name__ == "__main__":
    main()
