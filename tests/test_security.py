"""Security properties as tests: nothing a client or a peer rank sends is unpickled or evaluated; the
engine's ZMQ sockets live in a private (0700) directory, and an engine attaching over TCP must give the shared
secret (required beyond loopback); the API key is compared in constant time; the
server binds to 127.0.0.1 unless --host says otherwise."""

from __future__ import annotations

import asyncio
import re
import stat
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "parallel", "balancer", "experts", "moe", "kernels")
# deserialisers and evaluators that can run code from bytes; torch.distributed's *_object_list use pickle
UNSAFE = re.compile(r"\bpickle\b|\bcPickle\b|\bdill\b|\bmarshal\.loads|\bshelve\b|(?<![\w.])eval\(|(?<![\w.])exec\("
                    r"|\btorch\.load\(|\byaml\.load\(|\b(broadcast|all_gather|gather|scatter)_object_list\b"
                    r"|\b(send|recv)_object_list\b|\brecv_pyobj\b|\bsend_pyobj\b")


def _code_lines(path: Path):
    for i, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("#", 1)[0]
        yield i, code


def test_no_pickle_or_eval_in_the_packages():
    hits = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            in_doc = False
            for i, code in _code_lines(path):
                if code.count('"""') % 2:  # docstrings may name pickle to say it is not used
                    in_doc = not in_doc
                    continue
                if not in_doc and UNSAFE.search(code):
                    hits.append(f"{path.relative_to(REPO)}:{i}: {code.strip()}")
    assert not hits, "unsafe deserialisation or eval:\n" + "\n".join(hits)


def test_wire_formats_are_msgpack():
    from moe_serve.parallel import comm
    from moe_serve.server.frontend import engine_loop

    msg = {"type": "add", "request_id": "x", "prompt_token_ids": [1, 2], "params": {"n": 1}}
    assert engine_loop.unpack(engine_loop.pack(msg)) == msg
    assert "msgpack" in Path(comm.__file__).read_text() and "msgpack" in Path(engine_loop.__file__).read_text()


def test_zmq_sockets_in_a_private_directory(monkeypatch):
    from moe_serve.server.frontend import engine_client, engine_link
    from moe_serve.server.frontend.metrics import Metrics

    class NoProcess:
        def __init__(self, *a, **kw):
            self.args = kw["args"]

        def start(self):
            pass

        def is_alive(self):
            return False

        def join(self, timeout=None):
            pass

    class Ctx:
        Process = NoProcess

    monkeypatch.setattr(engine_link.multiprocessing, "get_context", lambda kind: Ctx)

    async def check():
        client = engine_client.EngineClient({"model": "unused"}, Metrics())
        client.spawn()
        try:
            mode = Path(client.ipc_dir).stat()
            assert stat.S_IMODE(mode.st_mode) == 0o700
            _, address, secret, _ = client.process.args
            assert address.startswith("ipc://") and Path(address.removeprefix("ipc://")).parent == Path(client.ipc_dir)
            assert len(secret) >= 32  # even the spawned engine says hello with a secret
        finally:
            await client.close()
        assert not Path(client.ipc_dir).exists()

    asyncio.run(check())


def test_frontend_beyond_loopback_needs_a_secret(capsys):
    from moe_serve.server.cli import main
    from moe_serve.server.frontend.engine_link import check_listen_address

    check_listen_address("tcp://127.0.0.1:5555", None)
    check_listen_address("tcp://0.0.0.0:5555", "s3cret")
    for address, secret, what in [("tcp://0.0.0.0:5555", None, "beyond loopback"), ("tcp://10.1.2.3:5555", "", "beyond"),
                                  ("ipc:///tmp/x", "s", "tcp://HOST:PORT"), ("tcp://127.0.0.1", "s", "tcp://HOST:PORT")]:
        with pytest.raises(ValueError, match=what):
            check_listen_address(address, secret)
    assert main(["serve", str(REPO / "models" / "tiny-fortunes"), "--frontend-only",
                 "--frontend-address", "tcp://0.0.0.0:5555"]) == 2
    assert "listens beyond loopback: set --frontend-secret" in capsys.readouterr().err


def test_engine_must_give_the_secret():
    """A peer without the secret is refused and can neither attach nor feed outputs; garbage is dropped."""
    import zmq

    from moe_serve.parallel.launch import free_port
    from moe_serve.server.frontend import engine_loop
    from moe_serve.server.frontend.engine_client import EngineClient
    from moe_serve.server.frontend.metrics import Metrics

    address = f"tcp://127.0.0.1:{free_port()}"

    async def check():
        client = EngineClient({"model": "unused"}, Metrics(), secret="right")
        client.listen(address)
        ctx = zmq.Context()
        try:
            with pytest.raises(RuntimeError, match="refused this engine: wrong or missing shared secret"):
                await asyncio.to_thread(engine_loop.attach, ctx, address, "wrong", 10)
            intruder = ctx.socket(zmq.DEALER)
            intruder.connect(address)
            intruder.send(b"\xc1 not msgpack")
            intruder.send(engine_loop.pack({"type": "ready", "max_model_len": 8, "vocab_size": 8}))
            await asyncio.sleep(0.5)
            assert client.generation == 0 and not client.alive and "no engine attached yet" in client.why_not_alive()
            intruder.close(linger=0)
            sock, welcome = await asyncio.to_thread(engine_loop.attach, ctx, address, "right", 10)
            assert welcome == {"type": "welcome", "placement": None}
            sock.send(engine_loop.pack({"type": "ready", "max_model_len": 8, "vocab_size": 8}))
            for _ in range(50):
                if client.alive:
                    break
                await asyncio.sleep(0.1)
            assert client.alive and client.generation == 1
            sock.close(linger=0)
        finally:
            ctx.term()
            await client.close()

    asyncio.run(check())


def test_api_key_compared_in_constant_time(monkeypatch):
    from moe_serve.server.frontend import api

    calls = []
    real = api.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api.hmac, "compare_digest", spy)
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    mw = api.APIKeyMiddleware(app, api_key="s3cret")
    for auth, path in [(b"Bearer s3cret", "/v1/completions"), (b"Bearer wrong", "/v1/models"), (None, "/v1/models")]:
        headers = [(b"authorization", auth)] if auth else []
        asyncio.run(mw({"type": "http", "method": "POST", "path": path, "headers": headers}, receive, send))
    assert reached == ["/v1/completions"]
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [401, 401]
    assert calls == [(b"Bearer s3cret", b"Bearer s3cret"), (b"Bearer wrong", b"Bearer s3cret"), (b"", b"Bearer s3cret")]
    assert "compare_digest" in Path(api.__file__).read_text() and "auth ==" not in Path(api.__file__).read_text()


def test_default_bind_is_loopback():
    from moe_serve.server.cli import build_parser

    args = build_parser().parse_args(["serve", "some/model"])
    assert args.host == "127.0.0.1"
    assert build_parser().parse_args(["serve", "m", "--host", "0.0.0.0"]).host == "0.0.0.0"
