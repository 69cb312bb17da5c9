"""A minimal P/D front for vLLM's own connectors under load: what each one's example proxy does,
served over HTTP so that ``vllm bench serve`` can drive it like any OpenAI server.

One process, one port per connector (``--fronts`` JSON: name, kind, port, P's and D's URLs and
what the kind needs). Kinds: ``nixl`` (P with ``max_tokens=1`` first, then D with the
``kv_transfer_params`` P returned), ``mooncake`` (P and D at once, one ``transfer_id``, D told
P's bootstrap address) and ``moriio-upstream`` (P and D at once, one ``X-Request-Id`` naming
both sides). D's answer streams back to the client byte for byte. Rules: a P that fails makes
the client's request fail (502 with P's error) when D has not answered yet; nothing else is
checked, retried or rewritten: the front is as thin as the connectors' own examples.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_peers import moriio_upstream as upstream  # noqa: E402

KINDS = ("nixl", "mooncake", "moriio-upstream")
NIXL_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict, params: dict) -> dict:
    """P's part: one token, not streamed, with the connector's parameters."""
    p_body = dict(body, max_tokens=1, stream=False, kv_transfer_params=params)
    for key in ("stream_options", "min_tokens"):
        p_body.pop(key, None)
    return p_body


def legs(front: dict) -> tuple[dict, dict | None, dict]:
    """(P's kv_transfer_params, D's or None when D takes P's answer, headers for both)."""
    kind = front["kind"]
    if kind == "nixl":
        return dict(NIXL_PREFILL), None, {}
    tid = f"tx-{uuid.uuid4()}"
    if kind == "mooncake":
        to_p = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
        to_d = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": tid,
            "remote_engine_id": "P",
            "remote_bootstrap_addr": front["p_bootstrap"],
        }
        return to_p, to_d, {}
    p_side = upstream.MoriioSide(*front["moriio_p"])
    d_side = upstream.MoriioSide(*front["moriio_d"])
    headers = {"X-Request-Id": upstream.request_id(p_side, d_side)}
    return upstream.prefill_params(tid), upstream.decode_params(tid), headers


def make_app(front: dict):
    """The aiohttp app of one front: ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``."""
    import aiohttp
    from aiohttp import web

    session: dict[str, aiohttp.ClientSession] = {}

    async def client() -> aiohttp.ClientSession:
        if "s" not in session:
            timeout = aiohttp.ClientTimeout(total=600)
            session["s"] = aiohttp.ClientSession(
                timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
            )
        return session["s"]

    async def post_prefill(body: dict, params: dict, headers: dict) -> dict:
        http = await client()
        async with http.post(
            f"{front['p']}/v1/completions", json=prefill_body(body, params), headers=headers
        ) as reply:
            data = await reply.read()
            if reply.status != 200:
                raise RuntimeError(f"P answered {reply.status}: {data[:300]!r}")
            return json.loads(data)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        to_p, to_d, headers = legs(front)
        prefill = asyncio.ensure_future(post_prefill(body, to_p, headers))
        try:
            if to_d is None:  # pull: D after P, with what P answered
                to_d = (await prefill)["kv_transfer_params"]
        except Exception as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=502)
        http = await client()
        async with http.post(
            f"{front['d']}/v1/completions",
            json=dict(body, kv_transfer_params=to_d),
            headers=headers,
        ) as reply:
            out = web.StreamResponse(
                status=reply.status,
                headers={"content-type": reply.headers.get("content-type", "application/json")},
            )
            await out.prepare(request)
            async for chunk in reply.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
        if not prefill.done():
            await asyncio.wait({prefill}, timeout=60)
        if prefill.done() and not prefill.cancelled():
            prefill.exception()  # P failing after D answered changes nothing now
        return out

    async def models(request: web.Request) -> web.Response:
        http = await client()
        async with http.get(f"{front['d']}/v1/models") as reply:
            return web.Response(
                body=await reply.read(), status=reply.status, content_type="application/json"
            )

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"front": front["name"]})

    async def close(app) -> None:
        if "s" in session:
            await session["s"].close()

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.on_cleanup.append(close)
    return app


def check_fronts(fronts: list) -> list[dict]:
    """The ``--fronts`` list, each entry checked; a ``ValueError`` names what is wrong."""
    if not isinstance(fronts, list) or not fronts:
        raise ValueError("--fronts: expected a non-empty JSON list of fronts")
    for index, front in enumerate(fronts):
        if not isinstance(front, dict):
            raise ValueError(f"--fronts[{index}]: expected an object")
        for key in ("name", "kind", "port", "p", "d"):
            if key not in front:
                raise ValueError(f"--fronts[{index}]: missing {key!r}")
        if front["kind"] not in KINDS:
            raise ValueError(f"--fronts[{index}]: kind must be one of {', '.join(KINDS)}")
        needs = {"mooncake": ("p_bootstrap",), "moriio-upstream": ("moriio_p", "moriio_d")}
        for key in needs.get(front["kind"], ()):
            if key not in front:
                raise ValueError(f"--fronts[{index}]: a {front['kind']} front needs {key!r}")
    return fronts


async def serve(fronts: list[dict]) -> None:
    from aiohttp import web

    runners = []
    for front in fronts:
        runner = web.AppRunner(make_app(front), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", int(front["port"])).start()
        runners.append(runner)
    print("fronts ready: " + ", ".join(f"{f['name']}:{f['port']}" for f in fronts), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for runner in runners:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fronts", required=True, help="JSON list of fronts (see the module)")
    args = parser.parse_args(argv)
    try:
        fronts = check_fronts(json.loads(args.fronts))
    except ValueError as exc:
        parser.error(str(exc))
    asyncio.run(serve(fronts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
