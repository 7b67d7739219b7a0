"Quiet, portable output: library notices dropped where the kit calls the library, real warnings kept."
import sys

from conftest import BIN, ROOT, run

NOTICE = "Setting accelerator to CPU"


def test_deepspeed_accelerator_notice_is_dropped_and_its_other_records_kept():
    code = ("import logging, marin_study.utils, deepspeed; "
            "logging.getLogger('DeepSpeed').warning('a real DeepSpeed warning')")
    done = run([sys.executable, "-c", code])
    printed = done.stdout + done.stderr
    assert NOTICE not in printed and "a real DeepSpeed warning" in printed
