"""Loss-scale unscaling of complex gradients (issue 30 item 6: the zoo's Fourier neural operator has a
complex64 weight; the fused unscale kernel has no complex implementation, so one fp16 trainer step
raised NotImplementedError)."""
from __future__ import annotations

import torch

from converter.train.amp_kernels import unscale_grads


def test_complex_grads_are_unscaled_through_their_real_view():
    param = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.cfloat))
    want = torch.randn(3, 4, dtype=torch.cfloat)
    param.grad = want * 1024
    found_inf = torch.zeros(())
    unscale_grads([param], inv_scale=torch.full((), 1 / 1024), found_inf=found_inf, allow_fp16=True)
    assert param.grad.dtype == torch.cfloat and torch.equal(param.grad, want), (param.grad - want).abs().max()
    assert found_inf.item() == 0.0


def test_a_non_finite_complex_grad_is_found():
    param = torch.nn.Parameter(torch.randn(2, dtype=torch.cfloat))
    param.grad = torch.tensor([1 + 1j, complex(float("inf"), 0)], dtype=torch.cfloat)
    found_inf = torch.zeros(())
    unscale_grads([param], inv_scale=torch.ones(()), found_inf=found_inf, allow_fp16=True)
    assert found_inf.item() == 1.0
