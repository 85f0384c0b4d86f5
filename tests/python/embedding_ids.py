"""Token ids for the remote-embeddings tests, from the `tokenizers` Python package (the
tokenizer SGLang and vLLM load through transformers), not from the Rust crate lockstep uses.

    pip install tokenizers==0.22.1
    python3 tests/python/embedding_ids.py TOKENIZER_JSON > tests/fixtures/embedding_ids.json

TOKENIZER_JSON is the test embedding tokenizer (`lockstep_tests::tokenizer::build_embedding`)
as `tokenizer.json`; the fixture carries it, so the test can check it is the same file.
"""

import json
import sys

import tokenizers

# Plain words, whitespace only (vLLM embeds it; SGLang refuses it as text), an empty text,
# tabs and newlines, and a repeat.
TEXTS = ["red green blue", "the cat sat", "   ", "", " red\tgreen\n", "red red red"]


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        raw = f.read()
    tok = tokenizers.Tokenizer.from_str(raw)
    cases = [
        {"text": t, "ids": tok.encode(t, add_special_tokens=True).ids} for t in TEXTS
    ]
    json.dump(
        {"tokenizers": tokenizers.__version__, "tokenizer": json.loads(raw), "cases": cases},
        sys.stdout,
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
