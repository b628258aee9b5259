"""`python -m ntl_pretrain.supervisor`, the path launch scripts copied before the move, runs `runtime.supervisor`."""

from ntl_pretrain.runtime.supervisor import main

if __name__ == "__main__":
    main()
