"""pytest set-up for nbval's runs over the chapters (`make test`).

nbval starts one Jupyter kernel per notebook. Rarely, with two pytest-xdist workers starting
kernels at once, a kernel never answers (seen once in about fifty starts here; jupyter_client
picks its TCP ports by opening and closing them before the kernel binds them, so two kernels can
pick the same port). nbval then fails every cell of that notebook after its start-up timeout. A
kernel that did not start is not a result of the chapter, so the start is tried up to three times;
a kernel that started and then misbehaves still fails the test as before.
"""

import nbval.kernel

ATTEMPTS = 3
_start_new_kernel = nbval.kernel.start_new_kernel


def start_new_kernel_with_retries(*args, **kwargs):
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return _start_new_kernel(*args, **kwargs)
        except RuntimeError:  # "Kernel didn't respond in N seconds"
            if attempt == ATTEMPTS:
                raise


nbval.kernel.start_new_kernel = start_new_kernel_with_retries
