from dsec.cli import main

main()
