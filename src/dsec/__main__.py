from dsec.sdk.cli import main

main()
