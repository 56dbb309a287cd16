"""A fake of Runpod's GraphQL API on a loopback port, with fault injection, for tests.

It parses the GraphQL text the `runpod` SDK sends (so a string the SDK pasted in unescaped
breaks it exactly as it would break the real API), answers only the fields the SDK asks for
(an unknown field is an error, as on a real GraphQL server), and keeps a small account:
GPU types with prices and capacity, pods, network volumes. Point the SDK at it with
`RUNPOD_API_BASE_URL=fake.url` (the SDK appends `/graphql`).

Faults are queued with `inject(kind, op=None, times=1)` and consumed by the next matching
request: `429`, `500` (JSON `errors`), `502`/`503` (an HTML body), `timeout` (the operation
runs, then the answer is held back for `delay` seconds: an ambiguous create), `late` (the request
is held for `delay` seconds before the operation runs: a create that completes long after it was
sent, whoever still waits for it), `drop` (the
operation runs, then the connection is closed unanswered), `drop_before` (closed unanswered,
nothing done), `nodata` (HTTP 200 with a JSON body that has no `data`).

Pod-scoped keys: Runpod gives every pod an `RUNPOD_API_KEY` of its own, "used to make RunPod API
calls to the specific pod. It's limited in scope to only the pod" (Runpod's pod environment
variables), with `RUNPOD_POD_ID`. The fake mints one per pod (`pod_key(pod_id)`), writes the pod's
container environment into `container_env_dir/<pod id>.environ` when that is set (NUL-separated, as
`/proc/1/environ` on a pod), and lets such a key read its own pod (`pod`), stop, resume and
terminate it (terminate only while `pod_keys_may_terminate`), nothing else. Runpod documents the
scope, not the answer to a call outside it; the fake gives the one Runpod gives a key lacking a
permission, a GraphQL error `Unauthorized` (the SDK raises it as a QueryError). A terminated pod's
key is refused like any unknown key (HTTP 401).
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import secrets
import string
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.fakes.tcp_relay import TcpRelay

NO_CAPACITY = (
    "There are no longer any instances available with the requested specifications. Please refresh and try again."
)
# What podResume answers when the machine the pod's volume lives on has no GPU free.
NOT_ENOUGH_FREE_GPUS = "There are not enough free GPUs on the host machine to start this pod."
# What a key is answered when it may not make a call (a pod's own key outside its pod).
UNAUTHORIZED = "Unauthorized"
# What a pod's own key may do, to its own pod only.
POD_KEY_OPS = {("query", "pod"), ("mutation", "podStop"), ("mutation", "podResume"), ("mutation", "podTerminate")}


# --- a small GraphQL parser (the subset the SDK sends) ---------------------------------------


class GraphQLSyntaxError(Exception):
    pass


_TOKEN = re.compile(
    r"""
    (?P<ws>[\s,\ufeff]+|\#[^\n]*)
  | (?P<punct>[{}()\[\]:!$=@])
  | (?P<number>-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
  | (?P<name>[_A-Za-z][_0-9A-Za-z]*)
  | (?P<string>")
    """,
    re.X,
)
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def tokenize(text: str) -> list[tuple[str, Any]]:
    """Tokens of a GraphQL document; strings decoded as the spec says (raw newlines are errors)."""
    out: list[tuple[str, Any]] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if not match:
            raise GraphQLSyntaxError(f"Syntax Error: Unexpected character {text[pos]!r} at {pos}.")
        kind = match.lastgroup
        if kind == "string":
            value, pos = _read_string(text, match.end())
            out.append(("string", value))
            continue
        if kind != "ws":
            out.append((kind, match.group(kind)))
        pos = match.end()
    out.append(("eof", None))
    return out


def _read_string(text: str, pos: int) -> tuple[str, int]:
    chars: list[str] = []
    while True:
        if pos >= len(text):
            raise GraphQLSyntaxError("Syntax Error: Unterminated string.")
        ch = text[pos]
        if ch == '"':
            return "".join(chars), pos + 1
        if ch in "\n\r":
            raise GraphQLSyntaxError("Syntax Error: Unterminated string.")
        if ord(ch) < 0x20 and ch != "\t":
            raise GraphQLSyntaxError(f"Syntax Error: Invalid character within String: {ch!r}.")
        if ch == "\\":
            nxt = text[pos + 1 : pos + 2]
            if nxt in _ESCAPES:
                chars.append(_ESCAPES[nxt])
                pos += 2
                continue
            if nxt == "u" and re.fullmatch(r"[0-9A-Fa-f]{4}", text[pos + 2 : pos + 6]):
                chars.append(chr(int(text[pos + 2 : pos + 6], 16)))
                pos += 6
                continue
            raise GraphQLSyntaxError(f"Syntax Error: Invalid character escape sequence: \\{nxt}.")
        chars.append(ch)
        pos += 1


@dataclass
class Field:
    name: str
    args: dict[str, Any] = field(default_factory=dict)
    selections: list[Field] | None = None
    alias: str | None = None


class Parser:
    def __init__(self, text: str) -> None:
        self.tokens = tokenize(text)
        self.i = 0

    def peek(self) -> tuple[str, Any]:
        return self.tokens[self.i]

    def take(self, kind: str, value: str | None = None) -> Any:
        tok = self.tokens[self.i]
        if tok[0] != kind or (value is not None and tok[1] != value):
            raise GraphQLSyntaxError(f"Syntax Error: Expected {value or kind}, found {tok[1]!r}.")
        self.i += 1
        return tok[1]

    def document(self) -> tuple[str, list[Field]]:
        kind, value = self.peek()
        op = "query"
        if kind == "name" and value in ("query", "mutation", "subscription"):
            op = self.take("name")
            if self.peek()[0] == "name":
                self.take("name")
        selections = self.selection_set()
        self.take("eof")
        return op, selections

    def selection_set(self) -> list[Field]:
        self.take("punct", "{")
        fields: list[Field] = []
        while self.peek() != ("punct", "}"):
            fields.append(self.field())
        self.take("punct", "}")
        if not fields:
            raise GraphQLSyntaxError("Syntax Error: Expected Name, found }.")
        return fields

    def field(self) -> Field:
        name = self.take("name")
        alias = None
        if self.peek() == ("punct", ":"):
            self.take("punct", ":")
            alias, name = name, self.take("name")
        args: dict[str, Any] = {}
        if self.peek() == ("punct", "("):
            self.take("punct", "(")
            while self.peek() != ("punct", ")"):
                key = self.take("name")
                self.take("punct", ":")
                args[key] = self.value()
            self.take("punct", ")")
        selections = self.selection_set() if self.peek() == ("punct", "{") else None
        return Field(name, args, selections, alias)

    def value(self) -> Any:
        kind, value = self.peek()
        if kind == "string":
            self.i += 1
            return value
        if kind == "number":
            self.i += 1
            return float(value) if any(c in value for c in ".eE") else int(value)
        if kind == "name":
            self.i += 1
            return {"true": True, "false": False, "null": None}.get(value, ("enum", value))
        if (kind, value) == ("punct", "["):
            self.take("punct", "[")
            items = []
            while self.peek() != ("punct", "]"):
                items.append(self.value())
            self.take("punct", "]")
            return items
        if (kind, value) == ("punct", "{"):
            self.take("punct", "{")
            obj = {}
            while self.peek() != ("punct", "}"):
                key = self.take("name")
                self.take("punct", ":")
                obj[key] = self.value()
            self.take("punct", "}")
            return obj
        raise GraphQLSyntaxError(f"Syntax Error: Unexpected {value!r}.")


class QueryFailure(Exception):
    """A GraphQL error: answered as `{"errors": [{"message": ...}]}`."""


def enum(value: Any) -> str:
    return value[1] if isinstance(value, tuple) and value[0] == "enum" else value


# --- the account ---------------------------------------------------------------------------------

POD_FIELDS = {
    "id", "containerDiskInGb", "costPerHr", "desiredStatus", "dockerArgs", "dockerId", "env", "gpuCount",
    "imageName", "lastStatusChange", "machineId", "memoryInGb", "name", "podType", "port", "ports",
    "uptimeSeconds", "vcpuCount", "volumeInGb", "volumeMountPath", "runtime", "machine",
}  # fmt: skip
GPU_FIELDS = {
    "id", "displayName", "memoryInGb", "maxGpuCount", "manufacturer", "cudaCores", "secureCloud",
    "communityCloud", "securePrice", "communityPrice", "oneMonthPrice", "threeMonthPrice",
    "oneWeekPrice", "communitySpotPrice", "secureSpotPrice", "lowestPrice",
}  # fmt: skip


@dataclass
class Gpu:
    id: str
    secure_price: float | None = 0.69
    community_price: float | None = 0.44
    capacity: int = 1000
    memory_gb: int = 24


@dataclass
class Injected:
    kind: str
    op: str | None
    times: int
    delay: float


class FakeRunpod:
    """The fake account and its HTTP server; state is guarded by one lock."""

    def __init__(self, *, api_keys: tuple[str, ...] = ("test-key",)) -> None:
        self.lock = threading.RLock()
        self.api_keys = set(api_keys)
        self.pod_keys: dict[str, str] = {}  # each pod's own key -> its pod id
        self.pod_keys_may_terminate = True  # False: a pod's key may stop its pod but not terminate it
        self.container_env_dir: Path | None = None  # where each pod's container environment is written
        self.gpus: dict[str, Gpu] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.terminated: dict[str, dict[str, Any]] = {}
        self.network_volumes = [{"id": "vol-eu", "name": "data", "size": 100, "dataCenterId": "EU-RO-1"}]
        self.faults: list[Injected] = []
        self.calls: list[tuple[str, int]] = []  # (root field, HTTP status) per request
        self.arrived: list[str] = []  # the root field of every request, as it arrives
        self.creates: list[dict[str, Any]] = []  # the decoded input of every create that ran
        self.ssh_endpoint: tuple[str, int] | None = None  # what new pods report for port 22
        # With relay_ssh each running pod gets its own port relaying to ssh_endpoint, which a stop
        # closes (cutting its connections) and a resume replaces, as on Runpod.
        self.relay_ssh = False
        self.relays: dict[str, TcpRelay] = {}
        self.ready_after = 1  # `pod` queries before a new pod shows its runtime
        self.closing = threading.Event()
        self.server: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None
        self.add_gpu(Gpu("NVIDIA GeForce RTX 4090"))
        self.add_gpu(Gpu("NVIDIA A40", secure_price=0.40, community_price=0.35))
        self.add_gpu(Gpu("NVIDIA H100 80GB HBM3", secure_price=2.99, community_price=2.69, memory_gb=80))

    # --- set-up and inspection ----------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add_gpu(self, gpu: Gpu) -> None:
        with self.lock:
            self.gpus[gpu.id] = gpu

    def set_capacity(self, gpu_id: str, count: int) -> None:
        with self.lock:
            self.gpus[gpu_id].capacity = count

    def inject(self, kind: str, op: str | None = None, times: int = 1, delay: float = 3.0) -> None:
        """Queue a fault for the next `times` requests whose root field is `op` (None: any)."""
        with self.lock:
            self.faults.append(Injected(kind, op, times, delay))

    def clear_faults(self) -> None:
        with self.lock:
            self.faults.clear()

    def pod_key(self, pod_id: str) -> str:
        """The pod's own key, as Runpod puts it in the pod's environment (RUNPOD_API_KEY)."""
        with self.lock:
            return next(key for key, pod in self.pod_keys.items() if pod == pod_id)

    def container_environ(self, pod_id: str) -> Path | None:
        """The file standing for the pod's `/proc/1/environ`, when `container_env_dir` is set."""
        return self.container_env_dir / f"{pod_id}.environ" if self.container_env_dir else None

    def _write_container_env(self, pod: dict[str, Any]) -> None:
        """A new container of the pod starts with its env, plus what Runpod adds to every pod."""
        path = self.container_environ(pod["id"])
        if path is None:
            return
        key = next(k for k, p in self.pod_keys.items() if p == pod["id"])
        items = [
            *pod["env"],
            f"RUNPOD_POD_ID={pod['id']}",
            f"RUNPOD_API_KEY={key}",
            f"RUNPOD_GPU_COUNT={pod['gpuCount']}",
        ]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(item.encode() + b"\0" for item in items))

    def _forget_pod_key(self, pod_id: str) -> None:
        for key in [k for k, p in self.pod_keys.items() if p == pod_id]:
            del self.pod_keys[key]

    def live_pods(self) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(p) for p in self.pods.values()]

    def terminate_from_outside(self, pod_id: str) -> None:
        """What a user clicking Terminate in the console, or Runpod reclaiming the machine, does."""
        with self.lock:
            pod = self.pods.pop(pod_id, None)
            if pod:
                self.terminated[pod_id] = {**pod, "terminated_at": time.time()}
            self._forget_pod_key(pod_id)
            self._close_ssh(pod_id)

    def stop_from_outside(self, pod_id: str) -> None:
        """What a user clicking Stop, or Runpod stopping a pod (spot interruption, low balance), does:
        the container ends, its port goes away, the volume stays. The test ends the processes."""
        with self.lock:
            self.pods[pod_id]["desiredStatus"] = "EXITED"
            self._close_ssh(pod_id)

    def _open_ssh(self, pod: dict[str, Any]) -> None:
        if self.relay_ssh and self.ssh_endpoint:
            relay = self.relays[pod["id"]] = TcpRelay(self.ssh_endpoint)
            pod["ssh"] = relay.address
        else:
            pod["ssh"] = self.ssh_endpoint

    def _close_ssh(self, pod_id: str) -> None:
        relay = self.relays.pop(pod_id, None)
        if relay is not None:
            relay.close()

    def add_foreign_pod(self, name: str, env: dict[str, str] | None = None) -> str:
        """A pod obd did not create (another tool, another obd install)."""
        with self.lock:
            spec = {
                "name": name,
                "imageName": "x",
                "gpuTypeId": "NVIDIA A40",
                "gpuCount": 1,
                "cloudType": ("enum", "SECURE"),
            }
            spec["env"] = [{"key": k, "value": v} for k, v in (env or {}).items()]
            return self._new_pod(spec)

    def ops(self) -> list[str]:
        with self.lock:
            return [op for op, _ in self.calls]

    # --- server --------------------------------------------------------------------------------

    def start(self) -> FakeRunpod:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                return

            def do_POST(self) -> None:
                fake._handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.closing.set()
        with self.lock:
            for pod_id in list(self.relays):
                self._close_ssh(pod_id)
        if self.server:
            self.server.shutdown()
            self.server.server_close()

    def __enter__(self) -> FakeRunpod:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- request handling --------------------------------------------------------------------------

    def _take_fault(self, op: str) -> Injected | None:
        with self.lock:
            for fault in self.faults:
                if fault.op is None or fault.op == op:
                    fault.times -= 1
                    if fault.times <= 0:
                        self.faults.remove(fault)
                    return fault
        return None

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        length = int(req.headers.get("Content-Length") or 0)
        body = req.rfile.read(length)
        if req.path != "/graphql":
            return self._send(req, 404, b"not found", "text/plain", "?")
        auth = req.headers.get("Authorization", "")
        key = auth[len("Bearer ") :] if auth.startswith("Bearer ") else ""
        with self.lock:
            scope = self.pod_keys.get(key)  # a pod's own key: that pod only
        if key not in self.api_keys and scope is None:
            return self._send_json(req, 401, {"errors": [{"message": UNAUTHORIZED}]}, "?")
        try:
            query = json.loads(body)["query"]
            op_kind, fields = Parser(query).document()
        except GraphQLSyntaxError as exc:
            return self._send_json(req, 400, {"errors": [{"message": str(exc)}]}, "syntax")
        except (ValueError, KeyError, TypeError):
            return self._send_json(req, 400, {"errors": [{"message": "Must provide query string."}]}, "?")
        op = fields[0].name
        if scope is not None and not self._pod_key_may(scope, op_kind, fields):
            return self._send_json(req, 200, {"errors": [{"message": UNAUTHORIZED, "path": [op]}], "data": None}, op)
        with self.lock:
            self.arrived.append(op)
        fault = self._take_fault(op)
        if fault and fault.kind == "drop_before":
            return self._drop(req, op)
        if fault and fault.kind in ("429", "500", "502", "503", "nodata"):
            return self._send_fault(req, fault.kind, op)
        if fault and fault.kind == "late":
            self.closing.wait(fault.delay)
        try:
            data = self._execute(op_kind, fields)
            payload: dict[str, Any] = {"data": data}
        except QueryFailure as exc:
            payload = {"errors": [{"message": str(exc), "path": [op]}], "data": None}
        if fault and fault.kind == "timeout":
            self.closing.wait(fault.delay)
        if fault and fault.kind == "drop":
            return self._drop(req, op)
        self._send_json(req, 200, payload, op)

    def _pod_key_may(self, pod_id: str, op_kind: str, fields: list[Field]) -> bool:
        """Whether a key scoped to `pod_id` may make every call of this request."""
        for f in fields:
            if (op_kind, f.name) not in POD_KEY_OPS or (f.args.get("input") or {}).get("podId") != pod_id:
                return False
            if f.name == "podTerminate" and not self.pod_keys_may_terminate:
                return False
        return True

    def _send_fault(self, req: BaseHTTPRequestHandler, kind: str, op: str) -> None:
        if kind == "429":
            return self._send(
                req, 429, b"<html><body>429 Too Many Requests</body></html>", "text/html", op, {"Retry-After": "1"}
            )
        if kind == "500":
            return self._send_json(req, 500, {"errors": [{"message": "Internal server error"}]}, op)
        if kind == "nodata":
            return self._send_json(req, 200, {"message": "upstream connect error"}, op)
        return self._send(req, int(kind), f"<html><body>{kind} Bad Gateway</body></html>".encode(), "text/html", op)

    def _drop(self, req: BaseHTTPRequestHandler, op: str) -> None:
        with self.lock:
            self.calls.append((op, 0))
        req.close_connection = True
        with contextlib.suppress(OSError):  # the client may have gone already
            req.connection.shutdown(2)

    def _send_json(self, req: BaseHTTPRequestHandler, status: int, payload: Any, op: str) -> None:
        self._send(req, status, json.dumps(payload).encode(), "application/json", op)

    def _send(
        self,
        req: BaseHTTPRequestHandler,
        status: int,
        body: bytes,
        ctype: str,
        op: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        with self.lock:
            self.calls.append((op, status))
        try:
            req.send_response(status)
            req.send_header("Content-Type", ctype)
            req.send_header("Content-Length", str(len(body)))
            for key, value in (headers or {}).items():
                req.send_header(key, value)
            req.end_headers()
            req.wfile.write(body)
        except OSError:
            pass

    # --- resolvers -----------------------------------------------------------------------------------

    def _execute(self, op_kind: str, fields: list[Field]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        with self.lock:
            for f in fields:
                resolver = getattr(self, f"_{op_kind}_{f.name}", None)
                if resolver is None:
                    kind = "Mutation" if op_kind == "mutation" else "Query"
                    raise QueryFailure(f'Cannot query field "{f.name}" on type "{kind}".')
                out[f.alias or f.name] = resolver(f)
        return out

    def _project(self, obj: Any, f: Field, type_name: str, known: set[str] | None = None) -> Any:
        if obj is None:
            return None
        if isinstance(obj, list):
            return [self._project(o, f, type_name, known) for o in obj]
        if f.selections is None:
            raise QueryFailure(f'Field "{f.name}" of type "{type_name}" must have a selection of subfields.')
        out = {}
        for sub in f.selections:
            if (known is not None and sub.name not in known) or sub.name not in obj:
                raise QueryFailure(f'Cannot query field "{sub.name}" on type "{type_name}".')
            value = obj[sub.name]
            if callable(value):
                value = value(sub.args)
            if isinstance(value, (dict, list)) and sub.selections is not None:
                value = self._project(value, sub, sub.name)
            elif isinstance(value, (dict, list)) and value and isinstance(value, dict):
                raise QueryFailure(f'Field "{sub.name}" must have a selection of subfields.')
            out[sub.alias or sub.name] = value
        return out

    def _query_myself(self, f: Field) -> Any:
        me = {
            "id": "user-1",
            "pubKey": "",
            "pods": [self._pod_view(p, count_poll=False) for p in self.pods.values()],
            "networkVolumes": self.network_volumes,
        }
        return self._project(me, f, "User")

    def _query_pod(self, f: Field) -> Any:
        pod_id = (f.args.get("input") or {}).get("podId")
        pod = self.pods.get(pod_id)
        return self._project(self._pod_view(pod), f, "Pod", POD_FIELDS) if pod else None

    def _query_gpuTypes(self, f: Field) -> Any:
        wanted = (f.args.get("input") or {}).get("id")
        gpus = [g for g in self.gpus.values() if wanted is None or g.id == wanted]
        return self._project([self._gpu_view(g) for g in gpus], f, "GpuType", GPU_FIELDS)

    def _mutation_podFindAndDeployOnDemand(self, f: Field) -> Any:
        spec = f.args.get("input") or {}
        for required in ("name", "imageName", "gpuTypeId", "cloudType"):
            if required not in spec:
                raise QueryFailure(
                    f'Field "PodFindAndDeployOnDemandInput.{required}" of required type was not provided.'
                )
        env = spec.get("env") or []
        for item in env:
            if (
                not isinstance(item, dict)
                or not isinstance(item.get("key"), str)
                or not isinstance(item.get("value"), str)
            ):
                raise QueryFailure("Expected type EnvironmentVariableInput.")
        volume_id = spec.get("networkVolumeId")
        if volume_id is not None:
            # The pod must be in the volume's data center (the SDK looks it up in `myself`).
            # The wording of these two errors is the fake's own.
            volume = next((v for v in self.network_volumes if v["id"] == volume_id), None)
            if volume is None:
                raise QueryFailure(f"Network volume {volume_id} was not found on this account.")
            if spec.get("dataCenterId") not in (None, volume["dataCenterId"]):
                raise QueryFailure(f"Network volume {volume_id} is in data center {volume['dataCenterId']}.")
        gpu = self.gpus.get(spec["gpuTypeId"])
        if gpu is None or gpu.capacity < int(spec.get("gpuCount") or 1):
            raise QueryFailure(NO_CAPACITY)
        gpu.capacity -= int(spec.get("gpuCount") or 1)
        self.creates.append(spec)
        pod = self.pods[self._new_pod(spec)]
        view = {**self._pod_view(pod, count_poll=False), "machine": {"podHostId": pod["id"] + "-host"}}
        return self._project(view, f, "Pod")

    def _mutation_podTerminate(self, f: Field) -> Any:
        pod_id = (f.args.get("input") or {}).get("podId")
        if pod_id not in self.pods:
            raise QueryFailure("pod not found to terminate")
        self.terminated[pod_id] = {**self.pods.pop(pod_id), "terminated_at": time.time()}
        self._forget_pod_key(pod_id)
        self._close_ssh(pod_id)
        if f.selections is not None:
            raise QueryFailure('Field "podTerminate" must not have a selection since type "Void" has no subfields.')
        return None

    def _mutation_podStop(self, f: Field) -> Any:
        pod = self.pods.get((f.args.get("input") or {}).get("podId"))
        if pod is None:
            raise QueryFailure("pod not found")
        pod["desiredStatus"] = "EXITED"
        self._close_ssh(pod["id"])
        return self._project(self._pod_view(pod, count_poll=False), f, "Pod")

    def _mutation_podResume(self, f: Field) -> Any:
        args = f.args.get("input") or {}
        pod = self.pods.get(args.get("podId"))
        if pod is None:
            raise QueryFailure("pod not found")
        if pod["desiredStatus"] != "RUNNING":
            gpu = self.gpus.get(pod["gpuTypeId"])
            if gpu is None or gpu.capacity < int(args.get("gpuCount") or 1):
                raise QueryFailure(NOT_ENOUGH_FREE_GPUS)
            # A new container: it boots again, with a new public port.
            pod.update(desiredStatus="RUNNING", polls=0, created=time.time())
            self._open_ssh(pod)
            self._write_container_env(pod)
        view = {**self._pod_view(pod, count_poll=False), "machine": {"podHostId": pod["id"] + "-host"}}
        return self._project(view, f, "Pod")

    def _new_pod(self, spec: dict[str, Any]) -> str:
        pod_id = "".join(random.choices(string.ascii_lowercase + string.digits, k=14))
        gpu = self.gpus.get(spec.get("gpuTypeId"))
        count = int(spec.get("gpuCount") or 1)
        cloud = enum(spec.get("cloudType"))
        price = None
        if gpu:
            price = gpu.community_price if cloud == "COMMUNITY" else gpu.secure_price
            if cloud == "ALL":
                price = gpu.community_price or gpu.secure_price
        self.pods[pod_id] = {
            "id": pod_id,
            "name": spec["name"],
            "imageName": spec.get("imageName"),
            "env": [f"{e['key']}={e['value']}" for e in spec.get("env") or []],
            "gpuCount": count,
            "gpuTypeId": spec.get("gpuTypeId"),
            "costPerHr": round((price or 0) * count, 4),
            "desiredStatus": "RUNNING",
            "created": time.time(),
            "polls": 0,
            "ssh": None,
            "containerDiskInGb": spec.get("containerDiskInGb"),
            "volumeInGb": spec.get("volumeInGb"),
            "volumeMountPath": spec.get("volumeMountPath"),
            "dockerArgs": spec.get("dockerArgs", ""),
            "networkVolumeId": spec.get("networkVolumeId"),
        }
        self.pod_keys[f"rpa_pod_{secrets.token_hex(20)}"] = pod_id
        self._open_ssh(self.pods[pod_id])
        self._write_container_env(self.pods[pod_id])
        return pod_id

    def _pod_view(self, pod: dict[str, Any] | None, count_poll: bool = True) -> dict[str, Any] | None:
        if pod is None:
            return None
        if count_poll:
            pod["polls"] += 1
        ready = pod["polls"] >= self.ready_after
        runtime = None
        if ready and pod["desiredStatus"] == "RUNNING":
            ports = [{"ip": "100.65.0.2", "isIpPublic": False, "privatePort": 8888, "publicPort": 8888, "type": "http"}]
            if pod["ssh"]:
                host, port = pod["ssh"]
                ports.append({"ip": host, "isIpPublic": True, "privatePort": 22, "publicPort": port, "type": "tcp"})
            runtime = {"ports": ports, "uptimeInSeconds": int(time.time() - pod["created"])}
        return {
            "id": pod["id"],
            "containerDiskInGb": pod["containerDiskInGb"],
            "costPerHr": pod["costPerHr"],
            "desiredStatus": pod["desiredStatus"],
            "dockerArgs": pod["dockerArgs"],
            "dockerId": None,
            "env": pod["env"],
            "gpuCount": pod["gpuCount"],
            "imageName": pod["imageName"],
            "lastStatusChange": f"Rented by User: {time.ctime(pod['created'])}",
            "machineId": pod["id"] + "-m",
            "memoryInGb": 62,
            "name": pod["name"],
            "podType": "RESERVED",
            "port": None,
            "ports": "22/tcp",
            "uptimeSeconds": int(time.time() - pod["created"]),
            "vcpuCount": 16,
            "volumeInGb": pod["volumeInGb"],
            "volumeMountPath": pod["volumeMountPath"],
            "runtime": runtime,
            "machine": {"gpuDisplayName": pod["gpuTypeId"], "podHostId": pod["id"] + "-host"},
        }

    def _gpu_view(self, gpu: Gpu) -> dict[str, Any]:
        def lowest(args: dict[str, Any]) -> dict[str, Any]:
            count = int((args.get("input") or {}).get("gpuCount") or 1)
            price = gpu.community_price or gpu.secure_price
            return {"minimumBidPrice": None, "uninterruptablePrice": price * count if price else None}

        return {
            "id": gpu.id,
            "displayName": gpu.id.replace("NVIDIA ", ""),
            "memoryInGb": gpu.memory_gb,
            "maxGpuCount": 8,
            "manufacturer": "Nvidia",
            "cudaCores": 0,
            "secureCloud": gpu.secure_price is not None,
            "communityCloud": gpu.community_price is not None,
            "securePrice": gpu.secure_price,
            "communityPrice": gpu.community_price,
            "oneMonthPrice": None,
            "threeMonthPrice": None,
            "oneWeekPrice": None,
            "communitySpotPrice": None,
            "secureSpotPrice": None,
            "lowestPrice": lowest,
        }
