from hf_dp_balance.apps.cli import main

raise SystemExit(main())
