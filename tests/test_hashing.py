"""The prefix-block hash chain: one rule, the same values in every process.

Router and workers compute block hashes in different processes (and on different machines); a
cached prefix is only found when both get the same integers. The values below are pinned: a change
to the hash (its algorithm, width, byte layout, salt rule) or a use of Python's randomized hash()
fails here first. Changing them on purpose is a breaking change of the router/worker protocol.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.block_manager import BlockManager
from engine.hashing import block_hashes, extend_block_hashes
from engine.request import Request
from engine.sampling_params import SamplingParams

# (token ids, block size, cache salt) -> hashes of the full blocks
PINNED = [  # 128-bit
    ((list(range(10)), 4, None), [109502450308554809884558943425843129888, 163774352182160970354461729950735350930]),
    ((list(range(10)), 4, "tenant-a"), [49599542831963386188375235023195871573,
                                         171189642506356330377656938586954623758]),
    (([151643, 0, 7, 2**32 - 1, 42, 9, 9, 9], 4, "é/ü"), [41453467129005036138909212494601800180,
                                                          174224396017132709823040227783781633688]),
    ((list(range(32)), 16, None), [282018991621687539825026627959752941038, 7526669653297796231912321973174739784]),
]


@pytest.mark.parametrize("args,expected", PINNED)
def test_pinned_values(args, expected):
    assert block_hashes(*args) == expected


def test_same_values_in_other_processes():
    """Fresh interpreters with different PYTHONHASHSEEDs compute the pinned values too."""
    code = ("import json, sys\nfrom engine.hashing import block_hashes\n"
            "print(json.dumps([block_hashes(*args) for args, _ in json.loads(sys.stdin.read())]))")
    root = Path(__file__).resolve().parents[1]
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(root)}
        out = subprocess.run([sys.executable, "-c", code], input=json.dumps(PINNED), env=env, cwd=root,
                             capture_output=True, text=True, check=True, timeout=60).stdout
        assert json.loads(out) == [expected for _, expected in PINNED]


def test_salt_changes_every_block():
    plain, salted = block_hashes(list(range(12)), 4), block_hashes(list(range(12)), 4, "t")
    assert all(a != b for a, b in zip(plain, salted))
    assert block_hashes(list(range(12)), 4, "") == plain  # an empty salt is no salt


def test_extending_a_chain_equals_hashing_it_whole():
    tokens = list(range(1000, 1037))
    whole = block_hashes(tokens, 4, "s")
    assert len(whole) == 9
    for cut in range(len(whole) + 1):
        assert extend_block_hashes(whole[:cut], tokens, 4, "s") == whole
    chain: list[int] = []
    for n in range(len(tokens) + 1):  # token by token, as a decode stream grows
        assert extend_block_hashes(chain, tokens[:n], 4, "s") is chain
    assert chain == whole


def test_block_manager_hashes_what_the_router_hashes():
    """The worker side (BlockManager, incremental as tokens arrive) gets the router's values."""
    tokens = list(range(10))
    req = Request("r", tokens[:5], SamplingParams(), 16, cache_salt="tenant-a")
    manager = BlockManager(8, 4)
    manager.update_block_hashes(req)
    for t in tokens[5:]:
        req.all_token_ids.append(t)
        manager.update_block_hashes(req)
    assert req.block_hashes == PINNED[1][1] == block_hashes(tokens, 4, "tenant-a")
