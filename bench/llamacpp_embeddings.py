"""llama.cpp's (llama-cpp-python's) embeddings of a GGUF model, as `llama-server --embeddings
--pooling P` computes them (the final norm's output pooled, scaled to unit length): the reference
`tests/tests/embeddings.rs` compares lockstep's `/v1/embeddings` with. For each text and pooling
(mean, cls, last): llama.cpp's token ids (no special tokens added: SmolLM2's GGUF adds no BOS) and
the unit vector, rounded to 6 decimals. Prints one JSON object.

    ~/.cache/lockstep-bench/venv-llama/bin/python bench/llamacpp_embeddings.py MODEL.gguf \
        > tests/fixtures/smollm2_embeddings.json
"""
import json
import math
import sys

import llama_cpp

path = sys.argv[1]
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors of numbers, one per input."]
POOLING = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
           "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}
out = {"llama_cpp_python": llama_cpp.__version__, "cases": []}
for name, kind in POOLING.items():
    llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=2, embedding=True, pooling_type=kind,
                          verbose=False)
    for text in TEXTS:
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)
        v = llm.embed(text, normalize=False)
        norm = math.sqrt(sum(x * x for x in v))
        out["cases"].append({"pooling": name, "text": text, "ids": ids,
                             "embedding": [round(x / norm, 6) for x in v]})
    del llm
print(json.dumps(out))
