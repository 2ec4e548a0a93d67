from hf_dp_balance.cli import main

raise SystemExit(main())
