"""ComfyUI workflows on the client side, standard library only: the UI format (what the frontend saves
and a user drags onto the canvas) converted to the API format (what POST /prompt takes), and an
API-format prompt checked against a server's node definitions (its /object_info) before it is queued.

    api = ui_to_api(json.load(open("workflow.json")), object_info)   # same node ids as the UI file
    for problem in check_prompt(api, object_info):
        print(problem)   # "node 4 (CheckpointLoaderSimple): the server has no model named ..."

The conversion does what ComfyUI's frontend does when it queues a workflow (v1.35, graphToPrompt):
widget values are matched to the widget inputs in the node definition's input order; muted (mode 2)
and bypassed (mode 4) nodes are left out, a link through a bypassed node goes on from its input of the
same type; frontend-only nodes (Note, MarkdownNote, Reroute, PrimitiveNode) are followed or dropped.
"""
from __future__ import annotations

import json

from .comfy import json_kind, listing, printable, shown

MAX_WORKFLOW_BYTES = 64 * 2**20  # a workflow file; a large one with embedded notes is a few MiB
MAX_WORKFLOW_DEPTH = 100  # JSON nesting; ComfyUI's formats need under 10 levels, a widget value a few more
MAX_NODE_ID_CHARS = 200  # a node id: '12', '12:5' inside a subgraph, '12.0.1' for a node the server expands
MAX_PROBLEMS_SHOWN = 20  # problems listed for a workflow the server cannot run; the rest are counted
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
SEED_NAMES = ("seed", "noise_seed")  # INT inputs the frontend gives a "control after generate" widget by name
MUTED, BYPASSED = 2, 4
VIRTUAL_NODES = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}  # the frontend's own; never sent to the server
# ComfyUI's V3 input types that the server resolves itself (match-type, multi-type, dynamic inputs):
# they link to anything, and a dynamic input `name` also takes the inputs `name.<sub>`.
DYNAMIC_TYPES = {"COMFY_AUTOGROW_V3", "COMFY_DYNAMICCOMBO_V3", "COMFY_DYNAMICSLOT_V3"}
OPEN_TYPES = {"*", "", "COMFY_MATCHTYPE_V3", "COMFY_MULTITYPED_V3"} | DYNAMIC_TYPES
# The folder a model-file input lists (object_info gives the files, not the folder), by input name.
MODEL_FOLDERS = {"ckpt_name": "checkpoints", "lora_name": "loras", "vae_name": "vae", "unet_name": "diffusion_models",
                 "clip_name": "text_encoders", "clip_name1": "text_encoders", "clip_name2": "text_encoders",
                 "clip_name3": "text_encoders", "clip_name4": "text_encoders", "control_net_name": "controlnet",
                 "style_model_name": "style_models", "gligen_name": "gligen", "hypernetwork_name": "hypernetworks",
                 "config_name": "configs", "upscale_model_name": "upscale_models"}
MODEL_FOLDERS_BY_CLASS = {("CLIPVisionLoader", "clip_name"): "clip_vision",
                          ("UpscaleModelLoader", "model_name"): "upscale_models"}
MODEL_EXTENSIONS = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".bin", ".gguf", ".onnx")


class WorkflowError(ValueError):
    """A workflow that cannot be converted or queued; the message names the node."""


def is_ui_format(workflow) -> bool:
    """True for the frontend's format ({"nodes": [...], "links": [...]}), False for the API format."""
    return isinstance(workflow, dict) and isinstance(workflow.get("nodes"), list)


# ---------------------------------------------------------------------------------------------------
# reading a workflow file and checking its shape: a workflow is untrusted (shared, downloaded)

def load_workflow(path: str) -> dict:
    """The JSON object in a workflow file. WorkflowError naming the file if it cannot be read, is over
    MAX_WORKFLOW_BYTES, is not UTF-8 or not JSON, nests deeper than MAX_WORKFLOW_DEPTH or is no object."""
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_WORKFLOW_BYTES + 1)
    except OSError as exc:
        raise WorkflowError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_WORKFLOW_BYTES:
        raise WorkflowError(f"{path}: larger than {MAX_WORKFLOW_BYTES} bytes: not a ComfyUI workflow")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise WorkflowError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    too_deep = WorkflowError(f"{path}: JSON nested more than {MAX_WORKFLOW_DEPTH} levels deep: not a ComfyUI workflow")
    try:
        workflow = json.loads(text)
    except RecursionError:  # nested past what json can read: far deeper than MAX_WORKFLOW_DEPTH
        raise too_deep from None
    except ValueError as exc:
        raise WorkflowError(f"{path}: {exc}") from None
    if _nested_deeper_than(workflow, MAX_WORKFLOW_DEPTH):
        raise too_deep
    if not isinstance(workflow, dict):
        raise WorkflowError(f"{path}: not a ComfyUI workflow (a JSON object of nodes)")
    return workflow


def _nested_deeper_than(value, most: int) -> bool:
    """True if lists and objects in `value` nest more than `most` levels deep (counted without recursion)."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if depth > most:
            return True
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        pending += [(child, depth + 1) for child in children if isinstance(child, (dict, list))]
    return False


def check_workflow(workflow: dict) -> None:
    """WorkflowError naming the node and field where a workflow (UI or API format) is not the shape kiln
    reads; nothing is sent to a server before this passes."""
    if is_ui_format(workflow):
        check_ui_workflow(workflow)
    else:
        check_api_workflow(workflow)


def check_api_workflow(prompt: dict) -> None:
    """WorkflowError for the first node of an API-format workflow that is not {"class_type": a name,
    "inputs": {...}, "_meta": {"title": text}} (_meta optional) under an id of printable text."""
    if is_ui_format(prompt):
        raise WorkflowError("this is a UI-format workflow: export it with 'Save (API)' (ComfyUI's API format)")
    for node_id, node in prompt.items():
        problem = api_node_problem(node_id, node)
        if problem:
            raise WorkflowError(problem)


def api_node_problem(node_id: str, node) -> str | None:
    """What is wrong with the shape of one node of an API-format workflow, naming the field; None if nothing."""
    where = f"workflow node {_shown_id(node_id)}"
    id_problem = node_id_problem(node_id)
    if id_problem:
        return f"{where}: its id {id_problem}"
    if not isinstance(node, dict):
        return f"{where}: must be a JSON object with 'class_type' and 'inputs', not {json_kind(node)} " \
               "(is this an API-format workflow?)"
    if "class_type" not in node:
        return f"{where}: no 'class_type' (is this an API-format workflow?)"
    if not isinstance(node["class_type"], str) or not node["class_type"]:
        return f"{where}: 'class_type' must be a node's name, not {shown(node['class_type'])}"
    if "inputs" not in node:
        return f"{where}: no 'inputs' (a JSON object of input name -> value, {{}} for none)"
    if not isinstance(node["inputs"], dict):
        return f"{where}: 'inputs' must be a JSON object, not {json_kind(node['inputs'])}"
    meta = node.get("_meta")
    if meta is not None and not isinstance(meta, dict):
        return f"{where}: '_meta' must be a JSON object, not {json_kind(meta)}"
    if meta is not None and meta.get("title") is not None and not isinstance(meta["title"], str):
        return f"{where}: '_meta' 'title' must be a string, not {json_kind(meta['title'])}"
    return None


def node_id_problem(node_id) -> str | None:
    """Why `node_id` is no node id (a string of printable text, at most MAX_NODE_ID_CHARS); None if it is one."""
    if not isinstance(node_id, str):
        return f"must be a string, not {json_kind(node_id)}"
    if not node_id:
        return "is empty"
    if len(node_id) > MAX_NODE_ID_CHARS:
        return f"is {len(node_id)} characters long (the most kiln takes is {MAX_NODE_ID_CHARS})"
    if not node_id.isprintable():
        return "has control characters"
    return None


def _shown_id(node_id) -> str:
    return node_id if isinstance(node_id, str) and not node_id_problem(node_id) else shown(node_id)


def check_ui_workflow(workflow: dict) -> None:
    """WorkflowError for the first node or link of a UI-format workflow that is not the shape ui_to_api
    reads, naming it and the field."""
    definitions = workflow.get("definitions")
    if definitions is not None and not isinstance(definitions, dict):
        raise WorkflowError(f"workflow 'definitions' must be a JSON object, not {json_kind(definitions)}")
    links = workflow.get("links")
    if links is not None and not isinstance(links, list):
        raise WorkflowError(f"workflow 'links' must be a list, not {json_kind(links)}")
    seen = set()
    for index, node in enumerate(workflow["nodes"]):
        node_id = _ui_node_id(index, node)
        if node_id in seen:
            raise WorkflowError(f"workflow node {node_id}: two nodes in 'nodes' have this id")
        seen.add(node_id)
        problem = _ui_node_problem(node)
        if problem:
            raise WorkflowError(f"workflow node {node_id}: {problem}")
    for index, link in enumerate(links or []):
        ui_link(index, link)


def _ui_node_id(index: int, node) -> str:
    """A UI-format node's id as the API format has it (a string); WorkflowError if it has none."""
    where = f"workflow 'nodes' entry {index}"
    if not isinstance(node, dict):
        raise WorkflowError(f"{where}: must be a JSON object (a node), not {json_kind(node)}: {shown(node)}")
    if "id" not in node:
        raise WorkflowError(f"{where}: no 'id'")
    node_id = node["id"]
    if isinstance(node_id, bool) or not isinstance(node_id, (int, str)):
        raise WorkflowError(f"{where}: 'id' must be a whole number or a string, not {json_kind(node_id)}")
    problem = node_id_problem(str(node_id))
    if problem:
        raise WorkflowError(f"{where}: 'id' {problem}")
    return str(node_id)


def _ui_node_problem(node: dict) -> str | None:
    """What is wrong with the fields of a UI-format node that ui_to_api reads; None if nothing."""
    if not isinstance(node.get("type"), str) or not node["type"]:
        return f"'type' must be a node's name, not {shown(node.get('type'))}"
    for key, kinds, wanted in (("mode", int, "a whole number"), ("title", str, "a string"),
                               ("inputs", list, "a list"), ("outputs", list, "a list"),
                               ("widgets_values", (list, dict), "a list or a JSON object")):
        value = node.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            return f"{key!r} must be {wanted}, not {json_kind(value)}"
    for index, entry in enumerate(node.get("inputs") or []):
        if not isinstance(entry, dict):
            return f"'inputs' entry {index} must be a JSON object, not {json_kind(entry)}"
        if not isinstance(entry.get("name"), str):
            return f"'inputs' entry {index}: 'name' must be a string, not {json_kind(entry.get('name'))}"
        link = entry.get("link")
        if link is not None and not _whole(link):
            return f"input {printable(entry['name'])!r}: 'link' must be a link's id (a whole number) or null, " \
                   f"not {json_kind(link)}"
    for index, entry in enumerate(node.get("outputs") or []):
        if not isinstance(entry, dict):
            return f"'outputs' entry {index} must be a JSON object, not {json_kind(entry)}"
    return None


def ui_link(index: int, link) -> tuple:
    """(id, origin node id, origin slot) of entry `index` of a UI-format workflow's links: the older
    [id, origin node, origin slot, target node, target slot, type] or the newer {"id", "origin_id",
    "origin_slot", ...}. WorkflowError naming the entry and the field that is not."""
    where = f"workflow 'links' entry {index}"
    if isinstance(link, dict):
        fields = [link.get(key) for key in ("id", "origin_id", "origin_slot")]
    elif isinstance(link, list) and len(link) >= 3:
        fields = link[:3]
    else:
        raise WorkflowError(f"{where}: must be [id, origin node, origin slot, target node, target slot, type] or "
                            f"a JSON object, not {shown(link)}")
    link_id, origin, slot = fields
    if not _whole(link_id):
        raise WorkflowError(f"{where}: its id must be a whole number, not {shown(link_id)}")
    if isinstance(origin, bool) or not isinstance(origin, (int, str)) or node_id_problem(str(origin)):
        raise WorkflowError(f"{where}: its origin node must be a node id, not {shown(origin)}")
    if not _whole(slot) or slot < 0:
        raise WorkflowError(f"{where}: its origin slot must be a whole number from 0, not {shown(slot)}")
    return link_id, str(origin), slot


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------------
# node definitions (one entry of /object_info)

def input_specs(info: dict) -> list[tuple[str, list]]:
    """(name, spec) of a node's inputs in the order the frontend lays out its widgets (required, then
    optional, each in `input_order` when the server gives it)."""
    declared = info.get("input") or {}
    order = info.get("input_order") or {}
    specs = []
    for section in ("required", "optional"):
        inputs = declared.get(section) or {}
        specs += [(name, inputs[name]) for name in order.get(section) or list(inputs) if name in inputs]
    return specs


def spec_options(spec) -> dict:
    return spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}


def spec_type(spec) -> str:
    """An input's type: a list of options is a COMBO."""
    return "COMBO" if isinstance(spec[0], list) else str(spec[0])


def is_widget(spec) -> bool:
    """The frontend shows this input as a widget (a value in widgets_values), not only as a socket."""
    return spec_type(spec) in WIDGET_TYPES and not spec_options(spec).get("forceInput")


def combo_options(spec):
    """A combo input's options, or None for any other input (or a combo whose options the server fetches)."""
    if isinstance(spec[0], list):
        return spec[0]
    options = spec_options(spec).get("options") if spec[0] == "COMBO" else None
    return options if isinstance(options, list) else None


def extra_widget_values(name: str, spec) -> int:
    """How many values the frontend stores after this widget's own: 'control after generate' for an INT
    (a seed's by default) and, for a combo, that and its filter list. (An upload button's value comes
    after all the widgets: the frontend adds that input last.)"""
    kind, options = spec_type(spec), spec_options(spec)
    if kind == "INT" and options.get("control_after_generate", name in SEED_NAMES):
        return 1
    if kind == "COMBO" and options.get("control_after_generate"):
        return 2
    return 0


def types_match(given: str, wanted: str) -> bool:
    """A link carrying `given` may feed an input of type `wanted` (ComfyUI's rule: equal, either open
    such as '*', or overlapping comma-separated lists like 'IMAGE,MASK')."""
    given_set = {t.strip() for t in str(given).split(",")}
    wanted_set = {t.strip() for t in str(wanted).split(",")}
    return bool(given_set & wanted_set) or bool((given_set | wanted_set) & OPEN_TYPES)


# ---------------------------------------------------------------------------------------------------
# UI format -> API format

def ui_to_api(workflow: dict, object_info: dict) -> dict:
    """The API-format prompt the frontend would queue for a UI-format workflow, with the same node ids.
    WorkflowError names every node the server has no definition for, or a broken link."""
    if not is_ui_format(workflow):
        raise WorkflowError("not a UI-format workflow (no 'nodes' list)")
    check_ui_workflow(workflow)
    if (workflow.get("definitions") or {}).get("subgraphs"):
        raise WorkflowError("this workflow has subgraphs, which kiln cannot convert: export it with "
                            "'Export (API)' in ComfyUI")
    graph = _UiGraph(workflow, object_info)
    unknown = [f"the server has no node '{printable(node['type'])}' (node {node_id}): is its node pack installed?"
               for node_id, node in graph.nodes.items()
               if _runs(node) and node["type"] not in object_info and node["type"] not in VIRTUAL_NODES]
    if unknown:
        raise WorkflowError("\n".join(unknown))
    prompt = {node_id: graph.api_node(node_id) for node_id, node in sorted(graph.nodes.items(), key=_id_order)
              if _runs(node) and node["type"] in object_info}
    for node in prompt.values():  # as the frontend: an input from a node that does not run is left out
        for name, value in list(node["inputs"].items()):
            if _is_link(value) and value[0] not in prompt:
                del node["inputs"][name]
    return prompt


def _runs(node: dict) -> bool:
    return node.get("mode", 0) not in (MUTED, BYPASSED)


def _id_order(item) -> tuple:
    node_id = item[0]
    digits = isinstance(node_id, str) and node_id.isascii() and node_id.isdigit()  # '²' is a digit to isdigit()
    return (0, int(node_id), "") if digits else (1, 0, str(node_id))


class _UiGraph:
    """A UI-format workflow's nodes and links, and how a link resolves to the output it carries."""

    def __init__(self, workflow: dict, object_info: dict):
        self.object_info = object_info
        self.nodes = {str(node["id"]): node for node in workflow["nodes"]}  # shapes checked by check_ui_workflow
        self.links = {}  # link id -> (source node id, output slot)
        for index, link in enumerate(workflow.get("links") or []):
            link_id, origin, slot = ui_link(index, link)
            self.links[link_id] = (origin, slot)

    def api_node(self, node_id: str) -> dict:
        node = self.nodes[node_id]
        info = self.object_info[node["type"]]
        entries = {entry["name"]: entry for entry in node.get("inputs") or []}
        values = node.get("widgets_values") or []
        inputs, position = {}, 0
        for name, spec in input_specs(info):
            entry = entries.get(name) or {}
            link = entry.get("link")
            # A widget keeps its place in widgets_values when it is linked too (an input entry with a
            # "widget" key); an input saved as a bare socket has none.
            if is_widget(spec) and (link is None or "widget" in entry):
                if isinstance(values, dict):  # some node packs save widget values by name
                    if name in values:
                        inputs[name] = _wrap(values[name])
                else:
                    if position < len(values):
                        inputs[name] = _wrap(values[position])
                    position += 1 + extra_widget_values(name, spec)
            if link is not None:
                source = self.resolve(link, entry.get("type", spec_type(spec)), f"node {node_id} input '{name}'")
                if source is not None:
                    inputs[name] = source
        title = node.get("title") or info.get("display_name") or node["type"]
        return {"inputs": inputs, "class_type": node["type"], "_meta": {"title": title}}

    def resolve(self, link_id, wanted: str, where: str):
        """[source node id, output slot] that a link delivers, through reroutes and bypassed nodes; a
        PrimitiveNode's value; or None when nothing arrives (a bypassed node with no input of the type)."""
        seen = set()
        while True:
            if link_id in seen:
                raise WorkflowError(f"{where}: its links go round in a loop (link {link_id})")
            seen.add(link_id)
            if link_id not in self.links:
                raise WorkflowError(f"{where}: link {link_id} is not in the workflow's links")
            source_id, slot = self.links[link_id]
            source = self.nodes.get(source_id)
            if source is None:
                raise WorkflowError(f"{where}: link {link_id} comes from node {source_id}, which is not in the workflow")
            if source.get("mode", 0) == BYPASSED:
                index = _bypass_input(source, slot, wanted)
                if index is None:
                    return None
                link_id = source["inputs"][index].get("link")
            elif source["type"] == "Reroute" and source["type"] not in self.object_info:
                link_id = (source.get("inputs") or [{}])[0].get("link")
            elif source["type"] == "PrimitiveNode" and source["type"] not in self.object_info:
                values = source.get("widgets_values") or []
                if not isinstance(values, list):
                    raise WorkflowError(f"{where}: link {link_id} comes from PrimitiveNode {source_id}, whose "
                                        f"'widgets_values' must be a list, not {json_kind(values)}")
                return _wrap(values[0]) if values else None
            else:
                return [source_id, slot]
            if link_id is None:
                return None


def _bypass_input(node: dict, slot: int, wanted: str):
    """The input of a bypassed node that its output `slot` passes through, for a link into an input of
    type `wanted` (the frontend's rule: the same slot if its type fits, else the first input of exactly
    that type, else the first that fits); None if none."""
    inputs = node.get("inputs") or []
    if not inputs:
        return None
    if wanted in ("*", ""):
        return slot if slot < len(inputs) else 0
    outputs = node.get("outputs") or []
    given = outputs[slot].get("type", "*") if slot < len(outputs) else "*"

    def fits(entry):
        return types_match(entry.get("type", "*"), given) and types_match(entry.get("type", "*"), wanted)

    if slot < len(inputs) and fits(inputs[slot]):
        return slot
    for index, entry in enumerate(inputs):
        if entry.get("type") == wanted:
            return index
    return next((index for index, entry in enumerate(inputs) if fits(entry)), None)


def _wrap(value):
    """A list widget value is sent boxed, so the server does not read it as a link (as the frontend does)."""
    return {"__value__": value} if isinstance(value, list) else value


def _is_link(value) -> bool:
    """[source node id, output index]: the server reads any such list as a link."""
    return isinstance(value, list) and len(value) == 2 and isinstance(value[1], int)


# Kiln's nodes that only compile or cache (what they return computes what their input computes)
KILN_COMPILE_NODES = ("KilnCompileUNet", "KilnCompileVAE", "KilnCompileControlNet", "KilnCacheGraph")


def without_nodes(prompt: dict, class_types) -> dict:
    """A copy of an API-format prompt with the nodes of these classes taken out, each one's consumers
    wired to its first linked input instead (for pass-through nodes: the MODEL, VAE or CONTROL_NET it
    wraps). `without_nodes(prompt, KILN_COMPILE_NODES)` is the same workflow run eagerly."""
    out = json.loads(json.dumps(prompt))
    removed = {k: out.pop(k) for k in [k for k, v in out.items() if v["class_type"] in class_types]}

    def source(link):
        while link[0] in removed:
            node_id = link[0]
            link = next((v for v in removed[node_id]["inputs"].values() if _is_link(v)), None)
            if link is None:
                raise WorkflowError(f"node {node_id} ({removed[node_id]['class_type']}) has no linked input "
                                    "to pass through")
        return link

    for node in out.values():
        node["inputs"] = {k: source(v) if _is_link(v) else v for k, v in node["inputs"].items()}
    return out


# ---------------------------------------------------------------------------------------------------
# checking an API-format prompt against the server's definitions

def check_prompt(prompt: dict, object_info: dict) -> list[str]:
    """What the server would refuse or could not run, each naming the node id and class: a node not in
    the API format's shape, a node class it lacks, a required input missing, an unknown input, a broken
    link, a link of the wrong type, a combo value that is not one of its options (a model file the server
    does not have). The workflow's and the server's text in them is cut short and without control
    characters (printable())."""
    problems = []
    for node_id, node in sorted(prompt.items(), key=_id_order):
        shape = api_node_problem(node_id, node)
        if shape:
            problems.append(shape)
            continue
        kind = node["class_type"]
        info = object_info.get(kind)
        if info is None:
            problems.append(f"the server has no node '{printable(kind)}' (node {node_id}): is its node pack installed?")
            continue
        problems += _check_node(f"node {node_id} ({printable(kind)})", node, info, prompt, object_info)
    return problems


def problems_shown(problems: list[str]) -> list[str]:
    """The first MAX_PROBLEMS_SHOWN problems, and a line saying how many more there are."""
    more = len(problems) - MAX_PROBLEMS_SHOWN
    return problems[:MAX_PROBLEMS_SHOWN] + ([f"... and {more} more problem(s) not shown"] if more > 0 else [])


def _check_node(where: str, node: dict, info: dict, prompt: dict, object_info: dict) -> list[str]:
    declared = dict(input_specs(info))
    sections = info.get("input") or {}
    dynamic = {name for name, spec in declared.items() if spec_type(spec) in DYNAMIC_TYPES}
    inputs = node["inputs"]
    problems = [f"{where}: required input '{printable(name)}' is missing" for name in sections.get("required") or {}
                if name not in inputs]
    for name, value in inputs.items():
        spec = declared.get(name)
        if spec is None:
            if name not in (sections.get("hidden") or {}) and name.split(".")[0] not in dynamic:
                problems.append(f"{where}: unknown input '{printable(name)}' (it takes: {listing(declared, 50)})")
        elif _is_link(value):
            problems += _check_link(where, name, spec, value, prompt, object_info)
        else:
            problems += _check_value(where, node["class_type"], name, spec, value)
    return problems


def _check_link(where: str, name: str, spec, link: list, prompt: dict, object_info: dict) -> list[str]:
    source_id, slot = link
    source = prompt.get(source_id) if isinstance(source_id, str) else None  # the server looks ids up as strings
    if not isinstance(source, dict):
        return [f"{where}: input '{printable(name)}' links to node {printable(source_id)}, which the prompt does not "
                "have"]
    kind = source.get("class_type")
    source_info = object_info.get(kind) if isinstance(kind, str) else None
    if source_info is None:
        return []  # that node's own problem says the server lacks it (or that it has no class_type)
    outputs = source_info.get("output") or []
    source_name = f"node {printable(source_id)} ({printable(kind)})"
    if not 0 <= slot < len(outputs):
        return [f"{where}: input '{printable(name)}' links to output {slot} of {source_name}, which has "
                f"{len(outputs)} output(s)"]
    given = "COMBO" if isinstance(outputs[slot], list) else outputs[slot]
    if not types_match(given, spec_type(spec)):
        return [f"{where}: input '{printable(name)}' takes {printable(spec_type(spec))}, but output {slot} of "
                f"{source_name} gives {printable(given)}"]
    return []


def _check_value(where: str, kind: str, name: str, spec, value) -> list[str]:
    options = combo_options(spec)
    if options is None or not isinstance(value, (str, int, float, bool)) or value in options:
        return []
    folder = MODEL_FOLDERS_BY_CLASS.get((kind, name)) or MODEL_FOLDERS.get(name)
    has = listing(options)
    name, text = printable(name), printable(value)
    if folder:
        return [f"{where}: the server has no model named '{text}' in {folder} (input {name}; it has {has})"]
    if str(value).lower().endswith(MODEL_EXTENSIONS):
        return [f"{where}: the server has no model file named '{text}' (input {name}; it has {has})"]
    if spec_options(spec).get("image_upload"):
        return [f"{where}: the server has no input image named '{text}' (input {name}; it has {has})"]
    return [f"{where}: input '{name}' is {printable(repr(value))}, which is not one of its options ({has})"]
