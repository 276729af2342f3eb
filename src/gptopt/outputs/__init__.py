"""How gptopt writes a user's disk so that nothing the user owns is lost (docs/design.md, "Nothing a user
owns is lost"): check an output before any work, hold one writer per output, publish it whole, replace only
what gptopt wrote and marked, and clean up after killed writers. Every verb that writes goes through here.

    python -c "from gptopt.outputs import staged_dir; help(staged_dir)"

staging.py: publishing a directory or file whole, the ownership mark, killed writers' leftovers;
aside.py: old entries set aside until the new ones stand; check.py: the check before any work;
lock.py: one writer per output.
"""

from gptopt.outputs.aside import Aside, recover, staged_files
from gptopt.outputs.check import check_output, check_writable, replacing, some
from gptopt.outputs.lock import lock_output
from gptopt.outputs.staging import (
                                    LOCK_FILE,
                                    OWNER_FILE,
                                    clean_stale,
                                    fsync_dir,
                                    mark,
                                    marked_kind,
                                    remove,
                                    replace_dir,
                                    staged_dir,
                                    staged_file,
                                    write_text_atomic,
)

__all__ = ["LOCK_FILE", "OWNER_FILE", "Aside", "check_output", "check_writable", "clean_stale", "fsync_dir",
           "lock_output", "mark", "marked_kind", "recover", "remove", "replace_dir", "replacing", "some", "staged_dir",
           "staged_file", "staged_files", "write_text_atomic"]
