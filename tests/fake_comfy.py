"""A stand-in ComfyUI for the client tests, standard library only, and the workflows and definitions
it serves (OBJECT_INFO, API_PROMPT, UI_WORKFLOW). The server: GET /object_info, POST /prompt,
GET /history/<id>, GET /view, POST /queue and /interrupt, and the /ws websocket (served with Kiln's own
frame functions) carrying the messages ComfyUI 0.8 sends while a prompt runs, in its order: status,
execution_start, execution_cached, executing per node, progress per sampling step, Kiln's progress text
(binary, type 3) on the Kiln node, executed, execution_success, the history record, executing null.

    with FakeComfy() as comfy:
        comfy.fail_on = "3"          # that node raises while running
        main(["queue", path, "--server", comfy.url])

It can also answer like a broken or hostile server: raw HTTP answers by endpoint (`answers`, built
with http_answer), history records edited (`edit_record`), raw websocket frames (`ws_frames`).
"""
import json
import queue
import struct
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kiln.client.websocket import CLOSE, TEXT, accept_key, encode_frame, parse_frame
from kiln.events import COMPILE_EVENT, CompileEvent

# Core definitions as ComfyUI 0.8's /object_info gives them (tooltips left out).
OBJECT_INFO = {
    "CheckpointLoaderSimple": {"input": {"required": {"ckpt_name": [["rand_sd15_tiny.safetensors"], {}]}},
                               "input_order": {"required": ["ckpt_name"]}, "output": ["MODEL", "CLIP", "VAE"],
                               "output_name": ["MODEL", "CLIP", "VAE"], "display_name": "Load Checkpoint"},
    "LoraLoader": {"input": {"required": {"model": ["MODEL"], "clip": ["CLIP"],
                                          "lora_name": [["rand_lora_tiny.safetensors"]],
                                          "strength_model": ["FLOAT", {"default": 1.0}],
                                          "strength_clip": ["FLOAT", {"default": 1.0}]}},
                   "input_order": {"required": ["model", "clip", "lora_name", "strength_model", "strength_clip"]},
                   "output": ["MODEL", "CLIP"], "output_name": ["MODEL", "CLIP"], "display_name": "Load LoRA"},
    "CLIPTextEncode": {"input": {"required": {"text": ["STRING", {"multiline": True}], "clip": ["CLIP"]}},
                       "input_order": {"required": ["text", "clip"]}, "output": ["CONDITIONING"],
                       "output_name": ["CONDITIONING"], "display_name": "CLIP Text Encode (Prompt)"},
    "EmptyLatentImage": {"input": {"required": {"width": ["INT", {"default": 512}], "height": ["INT", {"default": 512}],
                                                "batch_size": ["INT", {"default": 1}]}},
                         "input_order": {"required": ["width", "height", "batch_size"]}, "output": ["LATENT"],
                         "output_name": ["LATENT"], "display_name": "Empty Latent Image"},
    "KSampler": {"input": {"required": {"model": ["MODEL"], "seed": ["INT", {"control_after_generate": True}],
                                        "steps": ["INT", {"default": 20}], "cfg": ["FLOAT", {"default": 8.0}],
                                        "sampler_name": [["euler", "dpmpp_2m"]], "scheduler": [["normal", "karras"]],
                                        "positive": ["CONDITIONING"], "negative": ["CONDITIONING"],
                                        "latent_image": ["LATENT"], "denoise": ["FLOAT", {"default": 1.0}]}},
                 "input_order": {"required": ["model", "seed", "steps", "cfg", "sampler_name", "scheduler", "positive",
                                              "negative", "latent_image", "denoise"]},
                 "output": ["LATENT"], "output_name": ["LATENT"], "display_name": "KSampler"},
    "VAEDecode": {"input": {"required": {"samples": ["LATENT"], "vae": ["VAE"]}},
                  "input_order": {"required": ["samples", "vae"]}, "output": ["IMAGE"], "output_name": ["IMAGE"],
                  "display_name": "VAE Decode"},
    "SaveImage": {"input": {"required": {"images": ["IMAGE"], "filename_prefix": ["STRING", {"default": "ComfyUI"}]},
                            "hidden": {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"}},
                  "input_order": {"required": ["images", "filename_prefix"], "hidden": ["prompt", "extra_pnginfo"]},
                  "output": [], "output_name": [], "output_node": True, "display_name": "Save Image"},
    "PreviewImage": {"input": {"required": {"images": ["IMAGE"]}}, "input_order": {"required": ["images"]},
                     "output": [], "output_name": [], "output_node": True, "display_name": "Preview Image"},
    "PrimitiveInt": {"input": {"required": {"value": ["INT", {"control_after_generate": True}]}},
                     "input_order": {"required": ["value"]}, "output": ["INT"], "output_name": ["INT"],
                     "display_name": "Int"},
    "ImageBlend": {"input": {"required": {"image1": ["IMAGE"], "image2": ["IMAGE"],
                                          "blend_factor": ["FLOAT", {"default": 0.5}],
                                          "blend_mode": [["normal", "multiply"], {"control_after_generate": True}]}},
                   "input_order": {"required": ["image1", "image2", "blend_factor", "blend_mode"]},
                   "output": ["IMAGE"], "output_name": ["IMAGE"], "display_name": "Image Blend"},
    "KilnCompileUNet": {"input": {"required": {"model": ["MODEL"], "mode": [["fast", "balanced", "max"]]},
                                  "hidden": {"unique_id": "UNIQUE_ID"}},
                        "input_order": {"required": ["model", "mode"], "hidden": ["unique_id"]},
                        "output": ["MODEL", "STRING"], "output_name": ["MODEL", "report"],
                        "display_name": "Kiln › Compile UNet"},
}



def ui_node(node_id, kind, inputs=(), outputs=(), widgets=(), mode=0, title=None):
    node = {"id": node_id, "type": kind, "pos": [100 * node_id, 100], "size": [300, 120], "flags": {},
            "order": node_id, "mode": mode, "inputs": list(inputs), "outputs": list(outputs),
            "properties": {"Node name for S&R": kind}, "widgets_values": list(widgets)}
    if title:
        node["title"] = title
    return node


def socket(name, kind, link=None, widget=False):
    entry = {"name": name, "type": kind, "link": link}
    if widget:
        entry["widget"] = {"name": name}
    return entry


def out(name, kind, slot, links):
    return {"name": name, "type": kind, "links": links, "slot_index": slot}


# A txt2img graph as ComfyUI's frontend 1.35 saves it. The LoRA (10) is bypassed: MODEL and CLIP go
# through it from the checkpoint. The VAE goes through a Reroute (11). The sampler's steps come from an
# Int node (14) into its steps widget, which keeps its place in widgets_values. A preview (13) is muted.
UI_WORKFLOW = {
    "id": "0b7c5e64-6a7a-4c43-9a55-6f7f1a3a0c11", "revision": 0, "last_node_id": 14, "last_link_id": 16,
    "nodes": [
        ui_node(4, "CheckpointLoaderSimple", outputs=[out("MODEL", "MODEL", 0, [1]), out("CLIP", "CLIP", 1, [2]),
                                                      out("VAE", "VAE", 2, [3])],
                widgets=["rand_sd15_tiny.safetensors"]),
        ui_node(10, "LoraLoader", inputs=[socket("model", "MODEL", 1), socket("clip", "CLIP", 2)],
                outputs=[out("MODEL", "MODEL", 0, [4]), out("CLIP", "CLIP", 1, [5, 6])],
                widgets=["rand_lora_tiny.safetensors", 0.8, 0.8], mode=4),
        ui_node(6, "CLIPTextEncode", inputs=[socket("clip", "CLIP", 5)],
                outputs=[out("CONDITIONING", "CONDITIONING", 0, [7])], widgets=["a red fox in the snow"],
                title="Positive"),
        ui_node(7, "CLIPTextEncode", inputs=[socket("clip", "CLIP", 6)],
                outputs=[out("CONDITIONING", "CONDITIONING", 0, [8])], widgets=["blurry"], title="Negative"),
        ui_node(5, "EmptyLatentImage", outputs=[out("LATENT", "LATENT", 0, [9])], widgets=[256, 256, 1]),
        ui_node(14, "PrimitiveInt", outputs=[out("INT", "INT", 0, [16])], widgets=[3, "fixed"]),
        ui_node(3, "KSampler", inputs=[socket("model", "MODEL", 4), socket("positive", "CONDITIONING", 7),
                                       socket("negative", "CONDITIONING", 8), socket("latent_image", "LATENT", 9),
                                       socket("steps", "INT", 16, widget=True)],
                outputs=[out("LATENT", "LATENT", 0, [10])],
                widgets=[42, "randomize", 20, 7.0, "euler", "normal", 1.0]),
        ui_node(11, "Reroute", inputs=[socket("", "*", 3)], outputs=[out("", "VAE", 0, [11])]),
        ui_node(8, "VAEDecode", inputs=[socket("samples", "LATENT", 10), socket("vae", "VAE", 11)],
                outputs=[out("IMAGE", "IMAGE", 0, [12, 13])]),
        ui_node(9, "SaveImage", inputs=[socket("images", "IMAGE", 12)], widgets=["kiln/queue"]),
        ui_node(13, "PreviewImage", inputs=[socket("images", "IMAGE", 13)], mode=2),
        ui_node(12, "Note", widgets=["Kiln queue test: a bypassed LoRA, a Reroute, a muted preview."]),
    ],
    "links": [[1, 4, 0, 10, 0, "MODEL"], [2, 4, 1, 10, 1, "CLIP"], [3, 4, 2, 11, 0, "VAE"],
              [4, 10, 0, 3, 0, "MODEL"], [5, 10, 1, 6, 0, "CLIP"], [6, 10, 1, 7, 0, "CLIP"],
              [7, 6, 0, 3, 1, "CONDITIONING"], [8, 7, 0, 3, 2, "CONDITIONING"], [9, 5, 0, 3, 3, "LATENT"],
              [10, 3, 0, 8, 0, "LATENT"], [11, 11, 0, 8, 1, "VAE"], [12, 8, 0, 9, 0, "IMAGE"],
              [13, 8, 0, 13, 0, "IMAGE"], [16, 14, 0, 3, 4, "INT"]],
    "groups": [], "config": {}, "extra": {"ds": {"scale": 1, "offset": [0, 0]}}, "version": 0.4,
}

UI_EXPECTED = {
    "3": {"inputs": {"seed": 42, "steps": ["14", 0], "cfg": 7.0, "sampler_name": "euler", "scheduler": "normal",
                     "denoise": 1.0, "model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0],
                     "latent_image": ["5", 0]},
          "class_type": "KSampler", "_meta": {"title": "KSampler"}},
    "4": {"inputs": {"ckpt_name": "rand_sd15_tiny.safetensors"}, "class_type": "CheckpointLoaderSimple",
          "_meta": {"title": "Load Checkpoint"}},
    "5": {"inputs": {"width": 256, "height": 256, "batch_size": 1}, "class_type": "EmptyLatentImage",
          "_meta": {"title": "Empty Latent Image"}},
    "6": {"inputs": {"text": "a red fox in the snow", "clip": ["4", 1]}, "class_type": "CLIPTextEncode",
          "_meta": {"title": "Positive"}},
    "7": {"inputs": {"text": "blurry", "clip": ["4", 1]}, "class_type": "CLIPTextEncode", "_meta": {"title": "Negative"}},
    "8": {"inputs": {"samples": ["3", 0], "vae": ["4", 2]}, "class_type": "VAEDecode", "_meta": {"title": "VAE Decode"}},
    "9": {"inputs": {"filename_prefix": "kiln/queue", "images": ["8", 0]}, "class_type": "SaveImage",
          "_meta": {"title": "Save Image"}},
    "14": {"inputs": {"value": 3}, "class_type": "PrimitiveInt", "_meta": {"title": "Int"}},
}


# txt2img through Kiln › Compile UNet (node 2), on the definitions above.
API_PROMPT = {
    "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "rand_sd15_tiny.safetensors"},
          "_meta": {"title": "Load Checkpoint"}},
    "2": {"class_type": "KilnCompileUNet", "inputs": {"model": ["4", 0], "mode": "fast"},
          "_meta": {"title": "Kiln › Compile UNet"}},
    "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1},
          "_meta": {"title": "Empty Latent Image"}},
    "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a fox", "clip": ["4", 1]}, "_meta": {"title": "Positive"}},
    "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["4", 1]}, "_meta": {"title": "Negative"}},
    "3": {"class_type": "KSampler", "inputs": {"seed": 1, "steps": 3, "cfg": 7.0, "sampler_name": "euler",
                                               "scheduler": "normal", "denoise": 1.0, "model": ["2", 0],
                                               "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["5", 0]},
          "_meta": {"title": "KSampler"}},
    "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}, "_meta": {"title": "VAE Decode"}},
    "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "kiln", "images": ["8", 0]},
          "_meta": {"title": "Save Image"}},
}


def http_answer(body: bytes, status: str = "200 OK", length: int | None = None,
                content_type: str = "application/json") -> bytes:
    """A raw HTTP answer for FakeComfy.answers; `length` is the Content-Length it announces (the body's
    own by default: more cuts the body short)."""
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: "
            f"{len(body) if length is None else length}\r\nConnection: close\r\n\r\n").encode() + body


def kiln_compile_text(prompt: dict) -> list:
    """What Kiln › Compile UNet shows on itself for a prompt: a compile for each new batch size (a
    CompileEvent: its line is shown, and the record sent as Kiln's node sends it), then text lines."""
    batch = prompt["5"]["inputs"]["batch_size"]
    return [CompileEvent(0, 1.5 * batch, "inductor", True, f"first compile at batch {batch}"),
            f"Kiln variant: graph 0 compiled for batch {2 * batch}, latent 8x8 in {1.5 * batch:.1f}s",
            "cache miss for graph 0 (no entry), stored a 1.0 MiB entry"]


class FakeComfy:
    """Behaviour, set before queueing: reject (the JSON POST /prompt answers with status 400), fail_on (a node
    id that raises), hang (prompts never start), silent_end (a prompt's last messages are lost; its history
    has it), websocket (False: /ws is refused), kiln_text (prompt -> what Kiln's node shows: CompileEvents and lines of text, or None),
    step_seconds (per sampling step). A broken or hostile server: answers (endpoint, e.g. "/object_info",
    "/prompt", "/history", "/view" -> the raw bytes sent instead of its answer, then the connection is
    closed), edit_record (a history record -> what /history gives in its place), ws_frames (raw bytes
    sent on the websocket right after its first status message)."""

    def __init__(self):
        self.prompts: list[tuple[str, dict]] = []
        self.history: dict[str, dict] = {}
        self.cancelled: list[tuple[str, dict]] = []
        self.reject = None
        self.fail_on = None
        self.hang = False
        self.silent_end = False
        self.websocket = True
        self.kiln_text = kiln_compile_text
        self.step_seconds = 0.01
        self.answers: dict[str, bytes] = {}
        self.edit_record = None
        self.ws_frames: list[bytes] = []
        self.sockets: dict[str, tuple] = {}  # client id -> (socket, write lock)
        self.jobs: queue.Queue = queue.Queue()
        self.images = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.fake = self
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        threading.Thread(target=self._work, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.jobs.put(None)
        self.httpd.shutdown()
        for sock, _ in list(self.sockets.values()):
            sock.close()
        self.httpd.server_close()

    # -- the websocket, server side
    def send(self, client_id: str, event: str, data: dict) -> None:
        self._frame(client_id, TEXT, json.dumps({"type": event, "data": data}).encode())

    def send_progress_text(self, client_id: str, node_id: str, text: str) -> None:
        node = node_id.encode()
        self._frame(client_id, 0x2, struct.pack(">I", 3) + struct.pack(">I", len(node)) + node + text.encode())

    def _frame(self, client_id: str, opcode: int, payload: bytes) -> None:
        if client_id in self.sockets:
            self._send_raw(client_id, encode_frame(opcode, payload, mask=False))

    def _send_raw(self, client_id: str, data: bytes) -> None:
        sock, lock = self.sockets.get(client_id, (None, None))
        if sock is None:
            return
        with lock:
            try:
                sock.sendall(data)
            except OSError:  # the client has gone (it may hang up on a broken stream): nothing more to it
                self.sockets.pop(client_id, None)

    # -- running prompts, one at a time as ComfyUI does
    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            if self.hang:
                continue
            try:
                self._run(*job)
            except Exception as exc:  # a bug in the stand-in: fail the prompt at once rather than hang the test
                self.send(job[2], "execution_error", {"prompt_id": job[0], "node_id": "?", "node_type": "FakeComfy",
                                                      "exception_type": type(exc).__name__, "exception_message": str(exc)})

    def _run(self, prompt_id: str, prompt: dict, client_id: str) -> None:
        send = lambda event, **data: self.send(client_id, event, {**data, "prompt_id": prompt_id})  # noqa: E731
        messages = [["execution_start", {"prompt_id": prompt_id, "timestamp": 0}]]
        send("execution_start", timestamp=0)
        earlier = [p for pid, p in self.prompts if pid != prompt_id and pid in self.history]
        if prompt in earlier:  # ComfyUI's cache has every output: nothing runs
            send("execution_cached", nodes=list(prompt))
            outputs = next(r["outputs"] for pid, r in self.history.items() if dict(self.prompts)[pid] == prompt)
            return self._finish(prompt_id, client_id, outputs, messages)
        send("execution_cached", nodes=[])
        outputs = {}
        for node_id, node in prompt.items():
            send("executing", node=node_id, display_node=node_id)
            if node_id == self.fail_on:
                error = {"prompt_id": prompt_id, "node_id": node_id, "node_type": node["class_type"],
                         "exception_type": "RuntimeError", "exception_message": "boom\n", "traceback": []}
                self.send(client_id, "execution_error", error)
                messages.append(["execution_error", error])
                self.history[prompt_id] = {"prompt": [0, prompt_id, prompt, {}, []], "outputs": {},
                                           "status": {"status_str": "error", "completed": False, "messages": messages}}
                return send("executing", node=None)
            if node["class_type"] == "KSampler":
                text = self.kiln_text(prompt)
                kiln = [k for k, n in prompt.items() if n["class_type"].startswith("Kiln")]
                steps = node["inputs"]["steps"] if isinstance(node["inputs"]["steps"], int) else 2  # or a link
                for step in range(1, steps + 1):
                    send("progress", value=step, max=steps, node=node_id)
                    if step == 1 and text and kiln:
                        self.send_progress_text(client_id, kiln[0], "\n".join(
                            line.line() if isinstance(line, CompileEvent) else line for line in text))
                        for event in (line for line in text if isinstance(line, CompileEvent)):
                            self.send(client_id, COMPILE_EVENT, event.message(prompt_id, kiln[0]))
                    if step == 1:  # what is not Kiln's text: another node's, and a preview image
                        self.send_progress_text(client_id, "5", "width: 64, height: 64")
                        self._frame(client_id, 0x2, struct.pack(">I", 1) + struct.pack(">I", 1) + b"JPEG...")
                    time.sleep(self.step_seconds)
            if node["class_type"] == "SaveImage":
                batch = next(n["inputs"]["batch_size"] for n in prompt.values() if n["class_type"] == "EmptyLatentImage")
                images = []
                for _ in range(batch):
                    self.images += 1
                    images.append({"filename": f"kiln_{self.images:05}_.png", "subfolder": "", "type": "output"})
                outputs[node_id] = {"images": images}
                send("executed", node=node_id, display_node=node_id, output={"images": images})
        self._finish(prompt_id, client_id, outputs, messages)

    def _finish(self, prompt_id, client_id, outputs, messages) -> None:
        if not self.silent_end:
            self.send(client_id, "execution_success", {"prompt_id": prompt_id, "timestamp": 0})
        time.sleep(0.05)  # ComfyUI writes the history record after execution_success
        messages.append(["execution_success", {"prompt_id": prompt_id, "timestamp": 0}])
        prompt = dict(self.prompts)[prompt_id]
        self.history[prompt_id] = {"prompt": [0, prompt_id, prompt, {}, []], "outputs": outputs,
                                   "status": {"status_str": "success", "completed": True, "messages": messages}}
        if not self.silent_end:
            self.send(client_id, "executing", {"node": None, "prompt_id": prompt_id})


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    @property
    def fake(self) -> FakeComfy:
        return self.server.fake

    def _answer(self, code: int, body, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _raw_answer(self, path: str) -> bool:
        """Send the raw answer the test set for this endpoint, if any; True if it did."""
        raw = self.fake.answers.get("/" + path.split("/")[1])
        if raw is None:
            return False
        self.wfile.write(raw)
        self.wfile.flush()
        self.close_connection = True
        return True

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        if self._raw_answer(url.path):
            return
        if url.path == "/ws" and self.fake.websocket:
            return self._websocket(query.get("clientId", ""))
        if url.path == "/object_info":
            return self._answer(200, OBJECT_INFO)
        if url.path.startswith("/history/"):
            prompt_id = url.path.rsplit("/", 1)[-1]
            record = self.fake.history.get(prompt_id)
            if record and self.fake.edit_record:
                record = self.fake.edit_record(json.loads(json.dumps(record)))
            return self._answer(200, {prompt_id: record} if record else {})
        if url.path == "/view" and query.get("type") == "output":
            return self._answer(200, b"PNG " + query["filename"].encode(), "image/png")
        self._answer(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self._raw_answer(self.path):
            return
        if self.path == "/prompt":
            if self.fake.reject:
                return self._answer(400, self.fake.reject)
            prompt_id = uuid.uuid4().hex
            self.fake.prompts.append((prompt_id, body["prompt"]))
            self.fake.jobs.put((prompt_id, body["prompt"], body.get("client_id", "")))
            return self._answer(200, {"prompt_id": prompt_id, "number": len(self.fake.prompts), "node_errors": {}})
        if self.path in ("/queue", "/interrupt"):
            self.fake.cancelled.append((self.path, body))
            return self._answer(200, {})
        self._answer(404, {"error": "not found"})

    def _websocket(self, client_id: str) -> None:
        key = self.headers["Sec-WebSocket-Key"]
        sock, lock = self.connection, threading.Lock()
        with lock:  # registered before the handshake is answered, as ComfyUI does, so that no message to a
            # prompt queued right after the handshake is lost; the lock holds frames back until it is written
            self.fake.sockets[client_id] = (sock, lock)
            self.wfile.write(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                              f"Sec-WebSocket-Accept: {accept_key(key)}\r\n\r\n").encode())
            self.wfile.flush()
        self.fake.send(client_id, "status", {"status": {"exec_info": {"queue_remaining": 0}}, "sid": client_id})
        for frame in self.fake.ws_frames:
            self.fake._send_raw(client_id, frame)
        buffer = b""
        try:
            while True:
                frame = parse_frame(buffer)
                if frame is None:
                    data = sock.recv(65536)
                    if not data:
                        break
                    buffer += data
                    continue
                _, opcode, payload, used = frame
                buffer = buffer[used:]
                if opcode == CLOSE:
                    self.fake._frame(client_id, CLOSE, payload[:2])
                    break
        except OSError:
            pass  # the test ended and closed the socket
        finally:
            self.fake.sockets.pop(client_id, None)
            self.close_connection = True


# ---------------------------------------------------------------------------------------------------
# definitions from node classes, without a server (what ComfyUI's /object_info builds)

def object_info_from_classes(node_class_mappings: dict, display_names: dict | None = None) -> dict:
    """/object_info-shaped definitions built from node classes (INPUT_TYPES(), RETURN_TYPES, RETURN_NAMES,
    OUTPUT_NODE, CATEGORY ...) the way ComfyUI's server builds them, JSON round-tripped as the server
    sends them, so Kiln's own nodes can be checked without a server. A class whose INPUT_TYPES() needs
    ComfyUI (its model folders) raises ImportError naming it."""
    return {name: _node_info(name, cls, display_names or {}) for name, cls in node_class_mappings.items()}


def _node_info(name: str, cls, display_names: dict) -> dict:
    if hasattr(cls, "GET_NODE_INFO_V1"):  # ComfyUI's V3 node classes describe themselves
        return json.loads(json.dumps(cls.GET_NODE_INFO_V1()))
    try:
        declared = cls.INPUT_TYPES()
    except ImportError as exc:
        raise ImportError(f"{name}.INPUT_TYPES() needs ComfyUI: {exc}") from exc
    outputs = list(cls.RETURN_TYPES)
    info = {
        "input": declared,
        "input_order": {section: list(inputs) for section, inputs in declared.items()},
        "output": outputs,
        "output_is_list": list(getattr(cls, "OUTPUT_IS_LIST", [False] * len(outputs))),
        "output_name": list(getattr(cls, "RETURN_NAMES", outputs)),
        "name": name,
        "display_name": display_names.get(name, name),
        "description": getattr(cls, "DESCRIPTION", ""),
        "python_module": getattr(cls, "RELATIVE_PYTHON_MODULE", "nodes"),
        "category": getattr(cls, "CATEGORY", "sd"),
        "output_node": getattr(cls, "OUTPUT_NODE", False) is True,
    }
    for attribute, key in (("OUTPUT_TOOLTIPS", "output_tooltips"), ("DEPRECATED", "deprecated"),
                           ("EXPERIMENTAL", "experimental")):
        if getattr(cls, attribute, None):
            info[key] = getattr(cls, attribute)
    return json.loads(json.dumps(info))
