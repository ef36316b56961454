from extender.front.answering import main

main()
