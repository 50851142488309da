"""`kiln queue`: run a workflow through a running ComfyUI, headless, and say how long each prompt
queued and ran and what Kiln compiled for it.

    kiln queue workflow.json --server http://127.0.0.1:8188 --out images/
    kiln queue workflow.json --sweep 3.seed=1,2,3 --sweep 5.batch_size=1,2 --json results.json

The workflow is in API format (ComfyUI: Export (API)) or UI format (a saved workflow, converted with the
server's node definitions; node ids stay the same). Before anything is queued its shape is checked
(a node that is no JSON object, 'inputs' that are not one, ...: exit 2, naming the node and field), then,
unless --no-check, it is checked against those definitions: a node, a model file or an input the server
lacks stops it (exit 2). Each prompt is then submitted and followed over the websocket (progress on
stderr) until it ends. With --out, at most MAX_IMAGES_PER_PROMPT images of a prompt are downloaded: its
line says how many more there were, and the exit status is 1.
Exit status: 0 all prompts ran (and, with --out, all their images were downloaded), 1 a prompt failed,
the server did not answer (or too slowly) or a prompt's images were not all downloaded, 2 bad usage or
workflow.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

from .comfy import (ComfyClient, ComfyError, ComfyUnreachable, PromptFailed, PromptRejected, PromptTimedOut,
                    apply_sets, output_images, parse_value)
from .follow import PromptRun, follow, poll
from .progress_bar import ProgressBar
from .report import Result, prompt_line, sweep_table
from .websocket import WebSocket, WebSocketError
from .workflow import check_prompt, check_workflow, is_ui_format, load_workflow, problems_shown, ui_to_api

WEBSOCKET_CONNECT_SECONDS = 10.0  # the websocket's handshake, at most (or the timeout, if shorter)
MAX_IMAGES_PER_PROMPT = 1000  # images downloaded for one prompt (--out); the rest are counted, not downloaded


def seconds(text: str) -> float:
    """--timeout's value: a number of seconds above 0 (argparse refuses nan, inf, 0 and less)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workflow", help="a workflow file: API format (ComfyUI: Export (API)) or UI format (a saved "
                        "workflow, converted with the server's node definitions)")
    parser.add_argument("--server", default="http://127.0.0.1:8188")
    parser.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE",
                        help="change an input, e.g. --set 3.steps=4 (VALUE is JSON, else text; NODE is the node id, "
                        "the same in a UI-format file)")
    parser.add_argument("--sweep", action="append", default=[], metavar="NODE.INPUT=V1,V2,...",
                        help="queue one prompt per value, e.g. --sweep 3.seed=1,2,3; several --sweep queue every "
                        "combination")
    parser.add_argument("--repeat", type=int, default=1, metavar="N", help="queue each prompt N times (an unchanged "
                        "prompt is served from ComfyUI's cache: sweep a seed to make each one run)")
    parser.add_argument("--out", metavar="DIR", help="download each prompt's images into DIR")
    parser.add_argument("--json", metavar="FILE", help="write one record per prompt (timings, Kiln's compiles, "
                        "images) to FILE")
    parser.add_argument("--timeout", type=seconds, default=3600.0, help="seconds to wait for each prompt, and for "
                        "each answer of the server (default 3600)")
    parser.add_argument("--no-check", action="store_true", help="queue without checking the workflow against the "
                        "server's node definitions first (the server still validates it)")


def main(args: argparse.Namespace) -> int:
    try:
        workflow = load_workflow(args.workflow)
        check_workflow(workflow)
        sweeps = [parse_sweep(item) for item in args.sweep]
        if args.repeat < 1:
            raise ValueError(f"--repeat {args.repeat}: give 1 or more")
    except ValueError as exc:
        return _fail(str(exc), 2)
    client = ComfyClient(args.server, timeout=args.timeout)
    try:
        object_info = client.object_info()
    except ComfyError as exc:
        return _fail(str(exc), 1)
    try:
        prompt = apply_sets(ui_to_api(workflow, object_info) if is_ui_format(workflow) else workflow, args.set)
        jobs = expand(prompt, sweeps, args.repeat)
    except ValueError as exc:
        return _fail(str(exc), 2)
    if not args.no_check:
        problems = list(dict.fromkeys(problem for _, job in jobs for problem in check_prompt(job, object_info)))
        if problems:
            return _fail("the server cannot run this workflow:\n  " + "\n  ".join(problems_shown(problems)), 2)
    return run_all(client, jobs, args)


def parse_sweep(item: str) -> tuple[str, list[str]]:
    """'3.seed=1,2,3' -> ('3.seed', ['1', '2', '3'])."""
    target, equals, raw = item.partition("=")
    node, dot, name = target.partition(".")
    values = [value.strip() for value in raw.split(",") if value.strip()]
    if not equals or not dot or not node or not name or not values:
        raise ValueError(f"--sweep {item!r}: use NODE.INPUT=V1,V2,..., e.g. --sweep 3.seed=1,2,3")
    return target, values


def expand(prompt: dict, sweeps: list[tuple[str, list[str]]], repeat: int) -> list[tuple[dict, dict]]:
    """(swept settings, prompt) for every combination of the sweeps, each `repeat` times."""
    jobs = []
    for values in itertools.product(*(raw for _, raw in sweeps)):
        targets = [target for target, _ in sweeps]
        job = apply_sets(prompt, [f"{target}={value}" for target, value in zip(targets, values)])
        settings = {target: parse_value(value) for target, value in zip(targets, values)}
        jobs += [(settings, job)] * repeat
    return jobs


def run_all(client: ComfyClient, jobs: list[tuple[dict, dict]], args: argparse.Namespace,
            command: str = "kiln queue") -> int:
    """Queue each (swept settings, prompt) in turn and report it; args has out, json and timeout;
    `command` names the command in what goes wrong. The exit status: 0 if every prompt ran (and had all its
    images downloaded, with out), else 1."""
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    ws = _open_websocket(client, command)
    results, current = [], None
    try:
        for index, (settings, prompt) in enumerate(jobs, 1):
            result = Result(index, settings, uses_kiln=any(str(n.get("class_type", "")).startswith("Kiln")
                                                           for n in prompt.values()))
            run = PromptRun("", time.monotonic())
            current = run
            try:
                run.prompt_id = result.prompt_id = client.submit(prompt)
                ws = _wait(client, ws, run, prompt, ProgressBar(f"prompt {index}/{len(jobs)}"),
                           run.submitted + args.timeout, command)
                _fill(result, run, ws is not None, client, args.out)
            except (PromptRejected, PromptFailed) as exc:
                result.status, result.error = ("rejected" if isinstance(exc, PromptRejected) else "failed"), str(exc)
            except (ComfyUnreachable, PromptTimedOut) as exc:
                result.status, result.error = ("timed out" if isinstance(exc, PromptTimedOut) else "failed"), str(exc)
                results.append(result)
                print(prompt_line(result, len(jobs)), flush=True)
                break  # the server is gone, or busy with a prompt that did not end: the rest would fare no better
            results.append(result)
            print(prompt_line(result, len(jobs)), flush=True)
        current = None
    except KeyboardInterrupt:
        return _interrupted(client, current, command)
    except ComfyError as exc:  # an answer from the server that makes no sense (ServerAnswerError, an HTTP error)
        return _fail(str(exc), 1, command)
    finally:
        if ws is not None:
            ws.close()
    if len(jobs) > 1:
        print("\n" + sweep_table(results))
    if len(results) < len(jobs):
        print(f"{command}: stopped after prompt {len(results)} of {len(jobs)}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_json() for r in results], indent=2) + "\n")
    return 0 if len(results) == len(jobs) and all(r.status == "ok" and not r.images_not_downloaded
                                                  for r in results) else 1


def _open_websocket(client: ComfyClient, command: str):
    url = client.websocket_url()
    try:
        return WebSocket.connect(url, timeout=min(WEBSOCKET_CONNECT_SECONDS, client.timeout))
    except (OSError, WebSocketError) as exc:
        print(f"{command}: cannot open ComfyUI's websocket at {url} ({exc}): following the prompts by polling "
              "/history instead (no progress, no Kiln compile lines, each prompt's total time only)", file=sys.stderr)
        return None


def _wait(client: ComfyClient, ws, run: PromptRun, prompt: dict, bar: ProgressBar, deadline: float, command: str):
    """Follow the prompt to its end; the websocket to use for the next one (None once it broke)."""
    if ws is not None:
        try:
            follow(ws, client, run, prompt, bar, deadline)
            return ws
        except WebSocketError as exc:
            bar.done()
            ws.close()
            print(f"{command}: the websocket broke ({exc}): following the prompts by polling /history from here "
                  "(no progress, no Kiln compile lines, total times only)", file=sys.stderr)
            run.started = None
        except ComfyError:
            bar.done()  # the error's line starts on a line of its own
            raise
    poll(client, run, deadline)
    return None


def _fill(result: Result, run: PromptRun, followed: bool, client: ComfyClient, out) -> None:
    result.queue_seconds, result.run_seconds, result.total_seconds = run.queue_seconds, run.run_seconds, run.total_seconds
    if followed:
        result.kiln_compile_seconds = run.kiln_compile_seconds if result.uses_kiln else None
        result.kiln_variants, result.kiln_lines = run.kiln_variants, run.kiln_lines
        result.kiln_compiles = [{"node": shown["node"], "event": asdict(shown["event"])} for shown in run.kiln_compiles]
        result.nothing_ran = not run.executed
        result.left_out = dict(run.left_out)
    images = output_images(run.record)
    if out:
        result.images = [str(client.download(image, Path(out))) for image in images[:MAX_IMAGES_PER_PROMPT]]
        result.downloaded, result.images_not_downloaded = True, len(images[MAX_IMAGES_PER_PROMPT:])
    else:
        result.images = [image["filename"] for image in images]


def _interrupted(client: ComfyClient, run, command: str) -> int:
    if run is not None and run.prompt_id:
        try:
            client.cancel(run.prompt_id)
            print(f"\n{command}: interrupted: prompt {run.prompt_id} taken off the server's queue (or stopped)",
                  file=sys.stderr)
        except ComfyError as exc:
            print(f"\n{command}: interrupted; prompt {run.prompt_id} may still be on the server ({exc})", file=sys.stderr)
    else:
        print(f"\n{command}: interrupted", file=sys.stderr)
    return 130


def _fail(message: str, code: int, command: str = "kiln queue") -> int:
    print(f"{command}: {message}", file=sys.stderr)
    return code
