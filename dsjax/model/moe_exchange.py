"""Expert parallelism for the grouped implementations: the exchange of sorted rows (docs/moe.md).

Runs inside a shard_map manual over the experts' mesh axis (W devices, e = E / W experts each,
expert j on device j // e). Each device sorts its A assignments by owner, sends every peer the
rows routed to that peer's experts with each row's local expert id, the receiver runs the
grouped SwiGLU on what arrived, and the outputs go back the same way. Two transports
(`model.moe_exchange`):
- `static`: one `all_to_all` of a slot of A rows per peer, the bound when every row goes to one
  peer (XLA:CPU has no ragged all-to-all: "HLO opcode `ragged-all-to-all` is not supported by
  XLA:CPU ThunkEmitter"); W x A rows sent and received.
- `ragged`: `jax.lax.ragged_all_to_all` sends exactly the routed rows (A sent, at most W x A
  received). Needs a GPU or TPU; never run on one yet: tests/test_moe_grouped.py checks its
  offsets on CPU against an emulation of the collective.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from dsjax import fp8
from dsjax.model.moe_grouped import (Grouped, from_rows, grouped_swiglu, sort_rows, to_rows,
                                     weighted_sum)

ragged_all_to_all = lax.ragged_all_to_all  # tests substitute an emulation (CPU cannot run it)


def _exclusive(sizes: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(sizes, axis=axis) - sizes


def exchange(axis: str, x_TD: jax.Array, experts_TK: jax.Array, weights_TK: jax.Array,
             w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, num_experts: int,
             how: Grouped, metas: dict[str, fp8.Fp8Meta] | None = None) -> jax.Array:
    """sum_k weight_k * expert_k(x) for this device's T tokens, experts spread over `axis`."""
    K = experts_TK.shape[1]
    A = x_TD.shape[0] * K
    W = lax.axis_size(axis)
    e = num_experts // W
    expert_A = experts_TK.reshape(-1)
    owner_A = expert_A // e
    send = sort_rows(owner_A, W, None)  # rows [0, A) sorted by owner; send.sizes [W]
    x_AD = jnp.repeat(x_TD, K, axis=0)
    transport = _ragged if how.exchange == "ragged" else _static
    recv_x, recv_e, back = transport(axis, W, A, send, owner_A, x_AD, expert_A % e, e)
    layout = how.layout(recv_e, e)
    y_MD = grouped_swiglu(to_rows(recv_x, layout), w_gate, w_up, w_down, layout, how,
                          metas or {})
    return weighted_sum(back(from_rows(y_MD, layout)), weights_TK)


def _static(axis, W, A, send, owner_A, x_AD, local_A, e):
    """Slots of A rows per peer: row a goes to slot owner * A + its rank among the owner's."""
    D = x_AD.shape[-1]
    slot_A = owner_A * A + send.row - _exclusive(send.sizes)[owner_A]
    send_x = jnp.zeros((W * A, D), x_AD.dtype).at[slot_A].set(x_AD, unique_indices=True)
    send_e = jnp.full((W * A,), e, jnp.int32).at[slot_A].set(local_A, unique_indices=True)
    recv_x = lax.all_to_all(send_x.reshape(W, A, D), axis, 0, 0, tiled=True).reshape(W * A, D)
    recv_e = lax.all_to_all(send_e.reshape(W, A), axis, 0, 0, tiled=True).reshape(W * A)

    def back(y_RD):
        y = lax.all_to_all(y_RD.reshape(W, A, D), axis, 0, 0, tiled=True).reshape(W * A, D)
        return checkpoint_name(y, "moe_routed")[slot_A]  # saving it spares both all-to-alls

    return recv_x, recv_e, back


def _ragged(axis, W, A, send, owner_A, x_AD, local_A, e):
    """Exactly the routed rows: sender-side offsets into each receiver's buffer of W x A rows,
    in the order of the senders."""
    del owner_A
    if ragged_all_to_all is lax.ragged_all_to_all and jax.default_backend() == "cpu":
        raise NotImplementedError("model.moe_exchange='ragged' needs a GPU or TPU: XLA:CPU has "
                                  "no ragged-all-to-all; use moe_exchange='static'")
    D = x_AD.shape[-1]
    me = lax.axis_index(axis)
    sizes_SP = lax.all_gather(send.sizes, axis)  # [sender, receiver] row counts
    before_me = jnp.arange(W)[:, None] < me
    out_offsets = jnp.sum(jnp.where(before_me, sizes_SP, 0), axis=0)  # my rows' place at each
    recv_sizes = sizes_SP[:, me]
    sorted_x = jnp.zeros((A, D), x_AD.dtype).at[send.row].set(x_AD, unique_indices=True)
    sorted_e = jnp.zeros((A,), jnp.int32).at[send.row].set(local_A, unique_indices=True)
    go = lambda operand, fill: ragged_all_to_all(
        operand, jnp.full((W * A, *operand.shape[1:]), fill, operand.dtype), _exclusive(send.sizes),
        send.sizes, out_offsets, recv_sizes, axis_name=axis)
    recv_x, recv_e = go(sorted_x, 0), go(sorted_e, e)

    def back(y_RD):
        # Receiver -> sender: chunk s of my buffer returns to where sender s's rows for me began.
        mine_at = jnp.sum(jnp.where(jnp.arange(W)[None, :] < me, sizes_SP, 0), axis=1)
        y = ragged_all_to_all(y_RD, jnp.zeros((A, D), y_RD.dtype), _exclusive(recv_sizes),
                              recv_sizes, mine_at, send.sizes, axis_name=axis)
        return checkpoint_name(y, "moe_routed")[send.row]

    return recv_x, recv_e, back
