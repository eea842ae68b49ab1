"""What will the model see? The packing report, the data preview and the checks for the usual data bugs.

`packing_report` gives a dataset's length histogram, tokens kept, truncated and dropped, and the packing efficiency.
`preview` (train.py --preview, through progress.data_report) decodes the first documents, BOS/EOS visible and the
supervised text marked, then warns of each problem `check_examples` finds over all.
"""

import itertools
import sys

import numpy as np

from pack import pack_bfd
from support.data.tokenizer import segment


def packing_report(self, rows_per_batch=8):
    """A PackedDataset's length histogram, tokens kept / truncated / dropped, rows, and efficiency beside padded
    batching."""
    st, C, lens = self.stats, self.context_length, self.stats["lengths"]
    edges = [*range(0, C, C // 8), C + 1, max(C + 1, int(lens.max())) + 1]
    counts, _ = np.histogram(lens, bins=edges)
    pct = f"mean {lens.mean():.0f}, p50 {np.median(lens):.0f}, p95 {np.percentile(lens, 95):.0f}, max {lens.max()}"
    out = [f"examples: {st['examples']:,}; context_length {C}; lengths {pct}"]
    for lo, hi, c in zip(edges, edges[1:], counts, strict=False):
        out.append(f"  {f'{lo}-{hi - 1}' if lo <= C else f'> {C}':>12} {'#' * round(40 * c / counts.max()):<40} {c:,}")
    cut = f"truncated {st['truncated']:,} examples (-{st['truncated_tokens']:,} tokens)"
    drop = f"dropped {st['dropped']:,} ({st['dropped_tokens']:,} tokens)"
    out.append(f"tokens kept {self.num_tokens:,} (supervised {self.num_supervised:,}); {cut}; {drop}")
    shuffled = self.lens[np.random.default_rng(self.seed).permutation(len(self.lens))]
    longest = sum(int(b.max()) * len(b) for b in np.array_split(shuffled, -(-len(shuffled) // rows_per_batch)))
    packed = len(self.rows) if self.pack else len(pack_bfd(self.lens, C))
    eff = [f"{self.num_tokens / slots:.1%}" for slots in (packed * C, longest, len(shuffled) * C)]
    out.append(
        f"rows: {len(self.rows):,} ({'packed' if self.pack else 'one example each'}); efficiency (real tokens "
        f"/ slots): packed {eff[0]}, padded to the longest of {rows_per_batch} {eff[1]}, padded to {C} {eff[2]}"
    )
    return "\n".join(out)


def documents(examples, tokenizer, template=None, first=0, skip_bad_rows=False):
    """[(label, parts)] of the examples the template renders: each document's parts in order as (token ids, text,
    supervised), BOS and EOS (text None) where pack.document adds them, each text piece tokenized on its own."""
    segmented, _ = segment(examples, tokenizer, template, first, skip_bad_rows)
    encoded = tokenizer.encode_batch([text for *_, (pieces, _, _) in segmented for text, _ in pieces])
    bos, eos = ([tokenizer.bos_id], None, False), ([tokenizer.eos_id], None, True)
    out, start = [], 0
    for _, label, (pieces, add_bos, add_eos) in segmented:
        parts = [bos] if add_bos else []
        for (text, supervised), ids in zip(pieces, encoded[start : start + len(pieces)], strict=True):
            parts.append((ids, text, supervised))
            parts += [eos] if supervised and add_eos else []
        start += len(pieces)
        out.append((label, parts))
    return out


def _merges(docs, tok):
    """{j: the first cut of docs[j] between two text pieces where tokenizing them joined differs from apart}."""
    pairs = [(j, a, b) for j, (_, parts) in enumerate(docs) for a, b in itertools.pairwise(parts)]
    cuts = [(j, a, b) for j, a, b in pairs if a[1] and b[1]]  # BOS and EOS, ids without text, are not cut
    out = {}
    for (j, a, b), joined in zip(cuts, tok.encode_batch([a[1] + b[1] for _, a, b in cuts]), strict=True):
        if joined != a[0] + b[0]:
            out.setdefault(j, f"tokens merge across the cut {a[1][-20:]!r} | {b[1][:20]!r}")
    return out


def _warnings(docs, tok, train_on_prompt):
    """One line per problem: no supervised token, a double BOS, a response not ended by EOS or holding EOS before its
    end (an answer quoting the end-of-turn text), tokens that merge across a cut between pieces (pack.py tokenizes a
    document's pieces one by one)."""
    out, eos, merges = [], repr(tok.special_tokens.get("eos_token")), _merges(docs, tok)
    for j, (label, parts) in enumerate(docs):
        ids, mask = [t for p, _, _ in parts for t in p], [s or train_on_prompt for p, _, s in parts for _ in p]
        if not any(mask[1:]):  # the first token is nobody's target
            out.append(f"{label}: no supervised token")
        if ids[:2] == [tok.bos_id] * 2:
            out.append(f"{label}: double BOS {tok.decode(ids[:2])!r} at the start")
        responses = [k for k, (_, text, s) in enumerate(parts) if s and text is not None]
        for n, k in enumerate(responses, 1):
            end = parts[k + 1][0] if k + 1 < len(parts) and parts[k + 1][1] is None else parts[k][0]
            if end[-1:] != [tok.eos_id]:
                tail = parts[k][1][-20:]
                out.append(f"{label}: response {n} ends with {tail!r}, not EOS {eos}: the model will not stop")
            if tok.eos_id in parts[k][0][:-1]:
                out.append(f"{label}: response {n} holds EOS {eos} before its end: the model learns to stop there")
        if j in merges:
            out.append(f"{label}: {merges[j]}; the joined text tokenizes differently from its pieces")
    return out


def check_examples(examples, tokenizer, template=None, train_on_prompt=False, chunk=4096, skip_bad_rows=False):
    """The warnings of `preview` over all examples."""
    chunks = range(0, len(examples), chunk)
    docs = [documents(examples[f : f + chunk], tokenizer, template, f, skip_bad_rows) for f in chunks]
    return [w for d in docs for w in _warnings(d, tokenizer, train_on_prompt)]


def preview(examples, tokenizer, template=None, train_on_prompt=False, n=3, color=None, skip_bad_rows=False):
    """The first n examples as training sees them: decoded with BOS/EOS visible, supervised text marked (green on a
    terminal, in ⟦ ⟧ otherwise; color=None asks sys.stdout.isatty()), then one warning line per problem in them."""
    on, off = ("\x1b[32m", "\x1b[0m") if (sys.stdout.isatty() if color is None else color) else ("⟦", "⟧")
    docs, tok = documents(examples[:n], tokenizer, template, skip_bad_rows=skip_bad_rows), tokenizer
    name = lambda i: "none" if i is None else f"{tok.decode([i])!r} ({i})"
    out = [f"BOS {name(tok.bos_id)}, EOS {name(tok.eos_id)}, pad {name(tok.pad_id)}; supervised: {on}text{off}"]
    for label, parts in docs:
        runs = [(bool(s or train_on_prompt), ids) for ids, _, s in parts]
        grouped = [(k, [t for _, ids in g for t in ids]) for k, g in itertools.groupby(runs, key=lambda r: r[0])]
        n_sup = sum(len(ids) for k, ids in grouped if k)
        out.append(f"--- {label}: {sum(len(ids) for _, ids in grouped)} tokens, {n_sup} supervised ---")
        out.append("".join(on + tok.decode(ids) + off if k else tok.decode(ids) for k, ids in grouped))
    warnings = _warnings(docs, tok, train_on_prompt)
    return "\n".join(out + ([f"warning: {w}" for w in warnings] or [f"no warnings in the {len(docs)} examples shown"]))
