"""Print a store's manifest and figures; --verify decodes every unit and checks it.

    python -m extract.inspect STORE [--verify] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from shared.location import object_store_error
from shared.progress import progress_bar

from shared import compression as cx
from shared import schema as sc
from shared import store as st


def verify(path: str, progress: bool = True, damaged: list[int] | None = None) -> list[str]:
    """Every index entry inside its unit and non-overlapping; every unit marked done; every
    array decodes and matches the checksum taken before compression; no NaN in kept samples; the
    extraction finalized. A damaged unit is a problem of its own: the checks go on. `damaged`,
    if given, receives the units whose arrays are unreadable or differ from their checksum."""
    damaged = [] if damaged is None else damaged
    s = st.Store(path, require_complete=False)
    lay = s.layout
    problems = []
    try:
        index = s.index()
        offsets, lengths, ok = index["offset"], index["length"], index["ok"]
    except Exception as e:
        return [f"index: unreadable ({type(e).__name__}: {e}); re-extract the store"]
    units = offsets // lay.shard_tokens
    if (lengths <= 0).any():
        problems.append(f"{int((lengths <= 0).sum())} samples with no tokens")
    if ((offsets + lengths - 1) // lay.shard_tokens != units).any():
        problems.append("a sample straddles two units")
    order = np.argsort(offsets, kind="stable")
    if (offsets[order][1:] < (offsets + lengths)[order][:-1]).any():
        problems.append("samples overlap")
    done = st.done_units(path)
    by_unit = sc.samples_by_unit(offsets, lay.shard_tokens, lay.n_units)
    for u in progress_bar(range(lay.n_units), desc="verify", unit=" units", disable=not progress):
        if u not in done:
            problems.append(f"unit {u}: not written")
            continue
        bad = False
        for name, want in done[u]["crc32"].items():
            try:
                got = cx.crc(s.unit_array(name, u))
            except Exception as e:  # zarr's own checksum, a truncated shard, ...
                problems.append(f"unit {u}: {name} unreadable ({type(e).__name__}: {e})")
                bad = True
                continue
            if got != want:
                problems.append(f"unit {u}: {name} checksum {got:08x} != {want:08x} written")
                bad = True
        if bad:
            damaged.append(u)
        members = by_unit[u][ok[by_unit[u]] == 1]
        if lay.precision == "bf16" and len(members) and not bad:
            h = s.unit_hidden(u)
            for i in members:
                lo = offsets[i] - u * lay.shard_tokens
                if not h[lo:lo + lengths[i]].float().isfinite().all():
                    problems.append(f"sample {i}: non-finite features")
    if not s.manifest.complete:
        left = lay.n_units - len(done)
        problems.append("extraction not finished (" + (f"{left} of {lay.n_units} units to write" if left else
                        "every unit written, the store not finalized") + "): training refuses it; rerun the "
                        "same extract command to finish it")
    return problems


def check_target(path: str, target: str) -> list[str]:
    """TARGET against the fingerprints the store's manifest recorded: the weights' (safetensors
    headers, sizes, first and last MiB of each file) and every byte of embed_tokens and lm_head.
    Another checkpoint, revision or retrain differs; a flipped byte inside a layer's weights may
    not (compare the files' sha256 with their publisher's for that)."""
    from shared.target import TargetError, load_embed_and_head, tensors_fingerprint, weights_fingerprint
    t = st.Store(path, require_complete=False).manifest.target
    try:
        w, e = weights_fingerprint(target), tensors_fingerprint(*load_embed_and_head(target))
    except (OSError, ValueError, TargetError) as err:
        return [f"target {target}: unreadable ({err})"]
    out = []
    if w != t.weights_fingerprint:
        out.append(f"target {target}: weights fingerprint {w} != the store's {t.weights_fingerprint} "
                   f"(made from {t.path})")
    if e != t.tensors_fingerprint:
        out.append(f"target {target}: embed_tokens/lm_head fingerprint {e} != the store's {t.tensors_fingerprint}")
    return out


def describe(path: str) -> dict:
    s = st.Store(path, require_complete=False)
    man = s.manifest.to_dict()
    man["target"] = {k: v for k, v in man["target"].items() if k != "config"}
    man["progress"] = {"units_done": len(st.done_units(path)), "units": s.layout.n_units}
    man["disk_bytes"] = s.disk_bytes()
    return man


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m extract.inspect", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store")
    ap.add_argument("--verify", action="store_true", help="decode everything and check checksums")
    ap.add_argument("--json", action="store_true", help="print the manifest as JSON only")
    ap.add_argument("--target", default=None, help="with --verify: also check that this target (folder or "
                    ".gguf) is the store's, by the manifest's fingerprints")
    ap.add_argument("--repair", action="store_true", help="with --verify: forget the damaged units (their "
                    "markers) and reopen the store, so that rerunning its extraction command rewrites just them")
    a = ap.parse_args(argv)
    try:
        info = describe(a.store)
    except st.StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if (msg := object_store_error(e)) is None:
            raise
        print(f"error: STORE {a.store}: {msg}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(info, indent=2))
    else:
        t, lay = info["target"], info["layout"]
        print(f"store      {a.store}  (format {info['format_version']}, "
              f"{'complete' if info['complete'] else 'INCOMPLETE'}: {info['progress']['units_done']}/"
              f"{info['progress']['units']} units)")
        print(f"target     {t['path']}  {t['model_type']}  layers {t['num_hidden_layers']}  hidden "
              f"{t['hidden_size']}  vocab {t['vocab_size']}\n           weights {t['weights_fingerprint']}")
        print(f"tokenizer  {info['tokenizer']['fingerprint']}")
        print(f"layers     {info['layer_ids']}  ({info['layer_convention']})")
        print(f"features   {info['precision']}  codec {info['codec']}  top-k {info['topk']}  "
              f"max len {info['max_len']} ({info['too_long']})")
        print(f"template   chat_template_kwargs {json.dumps(info['chat_template_kwargs'])}  inexact turns "
              f"{info['run_key'].get('inexact_turns', 'split')}  strip reasoning "
              f"{info['run_key'].get('strip_reasoning', False)}")
        print(f"layout     {lay['n_samples']:,} samples in {lay['n_units']} units of {lay['shard_tokens']:,} "
              f"tokens, chunks of {lay['chunk_tokens']} tokens")
        print(f"data       {info['data']['spec']}  ({len(info['data']['files'])} file(s))")
        if info.get("summary"):
            sm = info["summary"]
            print(f"summary    {sm['samples']:,} samples  {sm['tokens']:,} tokens  skipped {sm['skipped'] or 'none'}")
            if sm.get("turns"):
                print(f"turns      {sm['turns']:,} trained  {sm['turns_split']:,} split ({sm['split_tokens']:,} "
                      f"tokens)  {sm['turns_context']:,} context only")
            print(f"disk       {info['disk_bytes'] / 2**20:,.1f} MiB  {sm['bytes_per_token']} B/token  "
                  f"{sm['compression_vs_raw_bf16']}x vs raw bf16")
    if a.repair and not a.verify:
        print("error: --repair goes with --verify (it repairs what verify finds)", file=sys.stderr)
        return 2
    if a.verify:
        damaged: list[int] = []
        problems = verify(a.store, damaged=damaged)
        if a.target:
            problems += check_target(a.store, a.target)
        for p in problems:
            print(f"PROBLEM {p}")
        print(f"verify: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        if a.repair and damaged:
            st.forget_units(a.store, damaged)
            print(f"repair: units {damaged} forgotten and the store reopened: rerun the extraction command "
                  f"that made it (same DATA, TARGET and options) to rewrite just these units")
        elif a.repair:
            print("repair: no damaged unit to rewrite" + (" (the problems above are not unit damage)" if problems else ""))
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
