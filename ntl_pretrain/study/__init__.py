"""The CE vs CE+NTL study: the `study` command (`commands`), its runs (`runs`, `archive`), the statistics and the
pre-registered decision (`stats`, `power`, `decision`, `token_classes`) and the report (`report`)."""
