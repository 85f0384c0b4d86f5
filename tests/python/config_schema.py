"""Every shipped router configuration validates against `config/lockstep.schema.json` (JSON
Schema 2020-12, `jsonschema`), the TOML files in config/ and bench/ and the ones the Kubernetes
ConfigMaps carry; a misspelt key, a wrong type and an unknown enum value each fail.

    python3 config_schema.py ROOT
"""

import copy
import glob
import json
import os
import sys
import tomllib

import jsonschema
import yaml

root = sys.argv[1]
schema = json.load(open(os.path.join(root, "config/lockstep.schema.json"), encoding="utf-8"))
jsonschema.Draft202012Validator.check_schema(schema)
validator = jsonschema.Draft202012Validator(schema)

shipped = {}
for path in sorted(glob.glob(os.path.join(root, "config/*.toml")) + glob.glob(os.path.join(root, "bench/*.toml"))):
    if os.path.basename(path) == "worker.toml":
        continue
    with open(path, "rb") as f:
        shipped[os.path.relpath(path, root)] = tomllib.load(f)
for path in sorted(glob.glob(os.path.join(root, "deploy/kubernetes/**/configmap.yaml"), recursive=True)):
    for doc in yaml.safe_load_all(open(path, encoding="utf-8")):
        for name, text in ((doc or {}).get("data") or {}).items():
            if name.endswith(".toml") and "[[models]]" in text and "[worker]" not in text:
                shipped[f"{os.path.relpath(path, root)}:{name}"] = tomllib.loads(text)

assert len(shipped) >= 8, sorted(shipped)
for name, cfg in shipped.items():
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(cfg)]
    assert not errors, (name, errors)

base = shipped["config/default.toml"]
wrong = []
# A misspelt key at the top, in a table, in a model.
a = copy.deepcopy(base)
a["sever"] = {}
wrong.append(("misspelt top-level table", a, "sever"))
b = copy.deepcopy(base)
b.setdefault("server", {})["http_lisen"] = "127.0.0.1:1"
wrong.append(("misspelt server key", b, "http_lisen"))
c = copy.deepcopy(base)
c["models"][0]["contxt_window"] = 4
wrong.append(("misspelt model key", c, "contxt_window"))
d = copy.deepcopy(base)
d["models"][0]["context_window"] = "big"
wrong.append(("wrong type", d, "context_window"))
e = copy.deepcopy(base)
e["models"][0]["backend"] = "tgi"
wrong.append(("unknown backend", e, "backend"))
for what, cfg, key in wrong:
    errors = list(validator.iter_errors(cfg))
    assert errors, what
    text = " ".join(e.message + str(list(e.absolute_path)) for e in errors)
    assert key in text or "tgi" in text or "big" in text, (what, text)
# The worker file's schema: config/worker.toml and the ConfigMaps' worker files.
wschema = json.load(open(os.path.join(root, "config/worker.schema.json"), encoding="utf-8"))
jsonschema.Draft202012Validator.check_schema(wschema)
wvalidator = jsonschema.Draft202012Validator(wschema)
workers = {}
with open(os.path.join(root, "config/worker.toml"), "rb") as f:
    workers["config/worker.toml"] = tomllib.load(f)
for path in sorted(glob.glob(os.path.join(root, "deploy/kubernetes/**/configmap.yaml"), recursive=True)):
    for doc in yaml.safe_load_all(open(path, encoding="utf-8")):
        for name, text in ((doc or {}).get("data") or {}).items():
            if name.endswith(".toml") and "[worker]" in text:
                workers[f"{os.path.relpath(path, root)}:{name}"] = tomllib.loads(text)
for name, cfg in workers.items():
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in wvalidator.iter_errors(cfg)]
    assert not errors, (name, errors)
w = copy.deepcopy(workers["config/worker.toml"])
w.setdefault("worker", {})["lisen"] = "127.0.0.1:1"
assert list(wvalidator.iter_errors(w)), "a misspelt worker key passed"
w = copy.deepcopy(workers["config/worker.toml"])
w.setdefault("engine", {})["kv_pages"] = "many"
assert list(wvalidator.iter_errors(w)), "a wrong engine type passed"
# Neither file validates as the other.
assert list(wvalidator.iter_errors(base)), "a router file passed as a worker file"
assert list(validator.iter_errors(workers["config/worker.toml"])), "a worker file passed as a router file"
print(f"{len(shipped)} shipped configurations and {len(workers)} worker files valid; {len(wrong)} wrong ones refused")
