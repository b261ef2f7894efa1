"""A recording stand-in for a vLLM or SGLang server (tests only).

Run as ``python _fake_inference_server.py --kind vllm|sglang ... --host H --port P`` (any
other arguments are accepted and recorded). It answers the endpoints areal's adapters use
with deterministic tokens (``prompt[-1] + 1, + 2, ...``, logprob ``-0.5`` each) and
appends one JSON line per event to the file named by ``AREAL_FAKE_SERVER_RECORD``:
``{"argv": [...], "env": {...}}`` at start, then ``{"method", "path", "query", "body"}``
per request.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(kind: str | None = None, argv: list[str] | None = None) -> None:
    from aiohttp import web

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser()
    p.add_argument("--kind", default=kind)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args, _ = p.parse_known_args(argv)
    record = os.environ["AREAL_FAKE_SERVER_RECORD"]

    def log(ev: dict) -> None:
        with open(record, "a") as f:
            f.write(json.dumps(ev) + "\n")

    log(
        {
            "argv": argv,
            "kind": args.kind,
            "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_"))},
        }
    )

    def tokens(prompt: list[int], n: int) -> list[int]:
        return [prompt[-1] + 1 + i for i in range(n)]

    async def handle(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        log(
            {
                "method": request.method,
                "path": request.path,
                "query": dict(request.query),
                "body": body,
            }
        )
        path = request.path
        if path == "/health":
            return web.json_response({})
        if args.kind == "vllm" and path == "/v1/completions":
            out = tokens(body["prompt"], body["max_tokens"])
            lp = {"tokens": [f"token_id:{t}" for t in out], "token_logprobs": [-0.5] * len(out)}
            choice = {"index": 0, "text": "", "finish_reason": "length", "logprobs": lp}
            return web.json_response({"choices": [choice]})
        if args.kind == "sglang" and path == "/generate":
            out = tokens(body["input_ids"], body["sampling_params"]["max_new_tokens"])
            meta = {
                "output_token_logprobs": [[-0.5, t, None] for t in out],
                "finish_reason": {"type": "length"},
            }
            return web.json_response({"output_ids": out, "meta_info": meta})
        return web.json_response({"success": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
