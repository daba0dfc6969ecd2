"""The launch cache keys on everything Triton specializes a kernel on (no GPU needed)."""

from types import SimpleNamespace

import torch

from mxfp8_a2a._fast_launch import Replay, _arg_key, _keys_and_values


def test_tensor_key_holds_dtype_and_16_byte_alignment():
    x = torch.zeros(64, dtype=torch.bfloat16)
    assert _arg_key(x) == (torch.bfloat16, True)
    assert _arg_key(x[8:]) == (torch.bfloat16, True)  # 16 bytes in
    assert _arg_key(x[1:]) == (torch.bfloat16, False)  # 2 bytes in
    assert _arg_key(x.float()) == (torch.float32, True)


def test_int_key_holds_one_multiple_of_16_and_width():
    assert _arg_key(1) == (True, False, True)
    assert _arg_key(32) == (False, True, True)
    assert _arg_key(33) == (False, False, True)
    assert _arg_key(0) == (False, True, True)
    assert _arg_key(2**31) == (False, True, False)
    assert _arg_key(2**31 - 1) == (False, False, True)
    assert len({_arg_key(v) for v in (1, 16, 17, 2**31, 2**31 + 1)}) == 5


def test_other_values_key_as_themselves():
    assert _arg_key(True) is True
    assert _arg_key(None) is None


def test_keys_and_values_key_like_arg_key_and_pass_addresses():
    x = torch.randn(40, dtype=torch.float32)
    args = (x, x[3:], 7, 1, 2**31, None)
    keys, values = _keys_and_values(args)
    assert keys == [_arg_key(a) for a in args]
    assert values == [x.data_ptr(), x[3:].data_ptr(), 7, 1, 2**31, None]


def test_replay_locates_arguments_in_their_bases():
    a = torch.zeros(64, dtype=torch.uint8)
    b = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert Replay._locate(a, (a, b)) == (0, 0)
    assert Replay._locate(a[5:], (a, b)) == (0, 5)
    assert Replay._locate(b[2:, 3:], (a, b)) == (1, (2 * 16 + 3) * 2)
    assert Replay._locate(torch.zeros(4), (a, b)) is None


def test_replay_build_rebases_tensors_and_keeps_empty_ones():
    compiled = SimpleNamespace(run=print, function=1, packed_metadata=2)
    a = torch.zeros(64, dtype=torch.uint8)
    empty = torch.empty(0, 16, dtype=torch.uint8)
    replay = Replay.build([(compiled, 3, (a[8:], empty, 5), (4,))], (a,))
    assert replay.steps == [(print, 1, 2, 3, [0, empty.data_ptr(), 5, 4], [(0, 0, 8)])]
    assert Replay.build([(compiled, 3, (torch.zeros(2),), ())], (a,)) is None
