"""What the watch tests run: transformers' KimiLinear on the bundled checkpoint with its own torch KDA
functions, a user's copy of its chunked function with the vLLM state-layout bug planted (the copy
names the function whose adapter maps it), and a small program for ``parity watch`` to run in a
subprocess (``PROGRAM``: it calls a user's torch recurrence, optionally in a child process, then
exits, crashes or waits to be interrupted)."""
from __future__ import annotations

import importlib

from parity.peers import transformers as peer
from parity.record.watch import same_as

MODULE = "transformers.models.kimi_linear.modeling_kimi_linear"
CHUNK = f"{MODULE}:chunk_kimi_delta_attention"
RECURRENT = f"{MODULE}:recurrent_kimi_delta_attention"
TARGETS = {"kda.chunked": CHUNK, "kda.recurrent": RECURRENT}


def modeling():
    return importlib.import_module(MODULE)


_TORCH: dict = {}


def torch_function(name: str):
    """transformers' own torch function (with fla-core installed the module name holds a wrapper
    that hands the call to fla's GPU kernels), as first found: the module name may hold a copy later."""
    if name not in _TORCH:
        _TORCH[name] = peer.chosen(getattr(modeling(), name))[0]
    return _TORCH[name]


@same_as(CHUNK)
def chunk_state_transposed(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' chunked KDA whose final state is written V-major into the K-major buffer."""
    o, state = torch_function("chunk_kimi_delta_attention")(
        query, key, value, g, beta, chunk_size=chunk_size, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if state is not None:
        state = state.transpose(-1, -2).contiguous().view(state.shape)
    return o, state


KERNEL = '''
import torch
from parity.watch import same_as


@same_as("fla.ops.kda.naive:naive_recurrent_kda")
def recurrent(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.clone()
    o = torch.zeros_like(v)
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        e = beta[:, t][..., None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t][..., None] * e[..., None, :]
        o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, (S if output_final_state else None)
'''

# a module with two watchable functions: ``recurrent`` held by a dispatcher built before a watch
# begins (the watch cannot replace it there), ``chunked`` that nothing calls
NEVER = KERNEL + '''

@same_as("fla.ops.kda.naive:naive_chunk_kda")
def chunked(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
    raise AssertionError("nothing calls this")


def dispatcher():
    impl = recurrent

    def dispatch(*args, **kwargs):
        return impl(*args, **kwargs)

    return dispatch
'''

# the KERNEL's recurrence, which then writes its inputs in place (a decode step's state pool, a
# buffer reused): the recorded inputs must be the values it was given
IN_PLACE = KERNEL + '''

@same_as("fla.ops.kda.naive:naive_recurrent_kda")
def recurrent_in_place(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    o, state = recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state)
    for t in (q, k, v, g, beta, initial_state):
        t.mul_(-3.0).add_(1.0)
    return o, state
'''

PROGRAM = '''
import os, subprocess, sys, time
import torch
import torch.nn.functional as F
from kern import recurrent     # the import hook wrapped kern.recurrent as kern loaded

torch.manual_seed(len(sys.argv))
state = None
for T in (5, 1, 1):
    q, k = (F.normalize(torch.randn(1, T, 2, 16), dim=-1) for _ in range(2))
    v, g, beta = torch.randn(1, T, 2, 8), -torch.rand(1, T, 2, 16), torch.rand(1, T, 2)
    o, state = recurrent(q, k, v, g, beta, initial_state=state, output_final_state=True)
mode = os.environ.get("MODE", "")
if mode.startswith("child") and len(sys.argv) == 1:
    subprocess.run([sys.executable, __file__, "child"], check=True)
if mode.endswith("crash"):
    raise RuntimeError("the program crashed")
if mode == "wait":
    print("ready", flush=True)
    time.sleep(120)
'''


@same_as(RECURRENT)
def recurrent_grouped(query, key, value, g, beta, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, **kwargs):
    """A copy of transformers' recurrent KDA called with grouped value heads, which it does not take."""
    return value, None
