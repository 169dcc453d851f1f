"""`python -m fcaudit ...`, and so `torchrun ... -m fcaudit audit ...`: the same command as `fcaudit`."""

from fcaudit.cli import main

if __name__ == "__main__":
    main()
