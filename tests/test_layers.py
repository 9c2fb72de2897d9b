"""Imports go one way, down the layers of DESIGN.md: a module never imports one above it."""

from __future__ import annotations

import ast
import pathlib

import shmshare

# rank: a module may import modules of the same or a lower rank only
LAYERS = {
    "_errors": 0, "_fork": 0, "_native": 0, "_procfs": 0, "_lifetime": 0, "_fd": 0,
    "_cgroup": 0, "_shmdir": 0, "_segcalls": 0,  # cgroup limits; /dev/shm; Segment's syscalls
    "_registry": 0,  # what pools and lease holders report, held weakly (Note [Reporters])
    "_typevars": 0,  # the type variables of the generic public classes
    "_sizes": 0,  # sizes as people write them (8M, 64MiB)
    "_timeouts": 0,  # timeouts as every call takes them
    "segment": 1,
    "wire": 2, "_sockets": 2, "_listen": 2,  # _sockets.py: wire's kernel side (SCM_RIGHTS, SO_PEERCRED)
    # the HELLO and peer checks; frames in shared memory beside the socket
    "_handshake": 2, "_ring": 2, "_ringmem": 2, "_handover": 2,
    "_pollserver": 2,  # the one accept/serve loop of the services that listen (Note [One poll server])
    "_statsd": 2,  # the opt-in stats socket: wire frames answering from _registry
    "memory": 3, "cuda": 3,
    "tensors": 4, "_empty_args": 4,  # what an empty() takes and hands out
    "_plane": 4,  # the data plane's core under the services: the lending pool and its books
    "channel": 5,
    "loader": 6, "server": 6, "multiprocessing": 6, "store": 6,
    "cli": 7, "_doctor": 7, "_demo": 7, "_stat": 7, "_statask": 7, "_termtable": 7, "__main__": 7,
    "__init__": 7,
}
ROOT = pathlib.Path(shmshare.__file__).parent


def _layer_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def _imports(path: pathlib.Path, package: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
                names = [f"{mod}.{a.name}" for a in node.names] if not node.module else [mod]
            else:
                names = [node.module or ""]
            found.update(n for n in names if n.startswith("shmshare"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("shmshare"))
    return found


def test_imports_go_down_the_layers():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts)
        if module.startswith("shmshare.testing"):
            continue  # testing may import anything
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        me = _layer_of(module.removesuffix(".__init__"))
        assert me in LAYERS, f"{module}: add its layer to LAYERS (and DESIGN.md)"
        for imp in _imports(path, package.removesuffix(".__init__")):
            if imp == "shmshare" or imp.startswith("shmshare.testing"):
                bad.append(f"{module} imports {imp}")
                continue
            other = _layer_of(imp)
            if other in LAYERS and LAYERS[other] > LAYERS[me]:
                bad.append(f"{module} (layer {LAYERS[me]}) imports {imp} (layer {LAYERS[other]})")
    assert not bad, "\n".join(bad)
