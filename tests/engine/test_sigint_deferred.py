import os
import signal

import pytest

from nanoserve.lifetime import sigint_deferred


def test_ctrl_c_inside_the_block_is_raised_once_the_block_ends():
    reached_end = False
    with pytest.raises(KeyboardInterrupt):
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            reached_end = True   # the import or setup the signal arrived in runs to its end
    assert reached_end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_sigint_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_error_inside_the_block_passes_through_with_the_handler_restored():
    with pytest.raises(SystemExit):
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            raise SystemExit(2)   # a refused flag
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
