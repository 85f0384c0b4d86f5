"""Regenerates gpu-engine/tests/fixtures/smollm2_teacher.json: llama.cpp's logits along a fixed
text of 257 tokens (teacher forcing: position i sees the text's tokens 0..=i), kept as the top 8
(token id, logit) per position for 256 positions, from its batched and its one-token path. CI compares against the stored file and needs
no llama.cpp.

    ~/.cache/lockstep-bench/venv-llama/bin/python scripts/gen-teacher-fixture.py "$(bash scripts/fetch-model.sh)"
"""
import json
import sys

import llama_cpp
import numpy as np

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press into a practical system. "
    "Before that, books were copied by hand, which made them rare and expensive. Within fifty years "
    "presses were running in more than two hundred cities across Europe, and millions of volumes had "
    "been printed. Scholars could now compare identical copies of a text, errors could be corrected "
    "in later editions, and ideas travelled faster than ever before. The Reformation, the scientific "
    "revolution and the rise of newspapers all depended on cheap printing. In 1605 the first weekly "
    "newspaper appeared in Strasbourg; by 1700 London had several daily papers. Printing also changed "
    "how people read: silent reading spread, punctuation became standard, and spelling slowly settled. "
    "Today we take printed and digital text for granted, but every page still follows conventions that "
    "the early printers invented: title pages, page numbers, indexes and tables of contents. Even the "
    "shape of many modern fonts goes back to types cut in Venice around 1470, and the words upper case "
    "and lower case come from the cases in which compositors kept their letters. Collectors now pay fortunes for the "
    "few surviving Gutenberg Bibles, and museums display them behind glass as the first great monument "
    "of the age of print."
)
path = sys.argv[1]
llm = llama_cpp.Llama(model_path=path, n_ctx=1024, logits_all=True, verbose=False, n_threads=2, n_batch=512)
ids = llm.tokenize(TEXT.encode(), add_bos=False)
assert len(ids) >= 257, len(ids)
ids = ids[:257]


def top8():
    out = []
    for i in range(256):
        logits = np.array(llm.scores[i])
        best = np.argsort(logits)[::-1][:8]
        out.append([[int(t), float(logits[t])] for t in best])
    return out


# llama.cpp's batched path (the whole text in one eval) and its one-token path round differently
# (they agree on top-1 at ~97% of positions themselves); keep both.
llm.reset()
llm.eval(ids)
batched = top8()
llm.reset()
for t in ids:
    llm.eval([t])
sequential = top8()
out = {"generator": "llama-cpp-python %s" % llama_cpp.__version__, "tokens": ids, "top": batched,
       "top_sequential": sequential}
with open("gpu-engine/tests/fixtures/smollm2_teacher.json", "w") as f:
    json.dump(out, f)
print("wrote", len(batched), "positions")
