"""``horovodrun``: horovod_ext's launcher (hvdrun) under Horovod's command name."""
import sys

from horovod_ext.launch import run as hvdrun


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-v", "--version"):
        import horovod
        print(f"horovodrun: horovod_ext {hvdrun.version()}'s launcher (hvdrun) with Horovod "
              f"{horovod.HOROVOD_API_VERSION}'s flags, from the horovod-ext-compat package; "
              f"not Horovod itself")
        return 0
    return hvdrun.main(argv)


if __name__ == "__main__":
    sys.exit(main())
