from marin_resources.k8s.render import main

raise SystemExit(main())
