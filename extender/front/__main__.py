"""`python -m extender.front`, as extender.front.spawn starts the answering process. Guarded, so that importing the
module (the image build's import check, pkgutil walks) defines it and nothing more."""

from extender.front.answering import main

if __name__ == "__main__":
    main()
