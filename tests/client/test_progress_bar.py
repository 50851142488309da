"""client/progress_bar.py: one line redrawn in place on a terminal, plain lines elsewhere."""
import io

from kiln.client.progress_bar import ProgressBar


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_one_line_is_redrawn():
    stream = Terminal()
    bar = ProgressBar("prompt 1/2", stream)
    bar.node("3", "KSampler (3)")
    bar.step("3", "KSampler (3)", 5, 20)
    bar.note("Kiln compiled graph 0 in 1.0s (fx, static shapes): first compile")
    bar.step("3", "KSampler (3)", 20, 20)
    bar.done()
    assert stream.getvalue() == (
        "\r\033[Kprompt 1/2  KSampler (3)"
        "\r\033[Kprompt 1/2  KSampler (3)  [######------------------]  5/20"
        "\r\033[Kprompt 1/2  Kiln compiled graph 0 in 1.0s (fx, static shapes): first compile\n"
        "\r\033[Kprompt 1/2  KSampler (3)  [########################]  20/20"
        "\r\033[K")


def test_elsewhere_plain_lines():
    stream = io.StringIO()
    bar = ProgressBar("prompt 1/1", stream)
    bar.node("3", "KSampler (3)")
    for step in range(1, 5):
        bar.step("3", "KSampler (3)", step, 4)
    bar.done()
    assert stream.getvalue() == "prompt 1/1  KSampler (3)\nprompt 1/1  KSampler (3)  4/4\n"


def test_kiln_s_work_takes_the_line_on_a_terminal_and_nothing_elsewhere():
    stream = Terminal()
    bar = ProgressBar("prompt 1/1", stream)
    bar.work("Kiln compile 3/11: region 4/11 ResBlock#2: pass fuse_geglu")
    bar.step("6", "KSampler (6)", 1, 2)
    assert stream.getvalue() == ("\r\033[Kprompt 1/1  Kiln compile 3/11: region 4/11 ResBlock#2: pass fuse_geglu"
                                 "\r\033[Kprompt 1/1  KSampler (6)  [############------------]  1/2")
    plain = io.StringIO()
    ProgressBar("prompt 1/1", plain).work("Kiln compile 3/11: region 4/11")
    assert plain.getvalue() == ""
