"""Process helpers the tests share."""


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent or init to reap it has died)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
