from ntl_pretrain.doctor.commands import main
from ntl_pretrain.runtime.process_group import exit_without_finalising

exit_without_finalising(main())
