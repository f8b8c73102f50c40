"""hfjax's entry points (`python -m launch.<name>`).

A launch process is never an IPython session, but flax imports IPython at its own import, when
installed, only to ask whether it runs in one (for coloured reprs): about 0.4 s of CPU in every
process, a few hundred of them in CI. Unless IPython is already loaded (a notebook running an
entry point's module), the import is answered "not installed" for this process.
"""

import sys

sys.modules.setdefault("IPython", None)
